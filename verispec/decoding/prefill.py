"""Which rows a round feeds their prompts to, and how much of them, and the prompts rows share.

A round feeds at most `chunk` prompt tokens over all the rows still being prefilled, the oldest requests first: a
row whose unseen prompt fits verifies along with its prefill, the first that does not fit feeds what is left, and
the rest wait. A prompt is computed once for the rows that share it (n choices of one prompt, requests of one
system prompt): a row being prefilled copies the longest prefix of its prompt that another row's target cache
holds (`Model.copy`), and waits while an older row still feeds more of it. The copied keys and values are those the
row would compute (see verispec.backends on batch invariance), so a row's tokens stay its own."""

from __future__ import annotations

from verispec.backends.base import Model, common_prefix_length
from verispec.decoding.row import Row

SHARED_PREFIX = 32  # prompt tokens a row must gain to copy them from another row's cache (or wait for them)


def prefill_plan(active: list[Row], target: Model, chunk: int) -> tuple[list[Row], dict[Row, int]]:
    """The rows that verify this round (in slot order) and those that only feed part of their prompt (how many
    tokens); the rows in neither wait."""
    budget, parts, waiting = chunk, {}, set()
    for row in sorted(active, key=lambda r: r.started):
        if len(row.seq) - target.lengths[row.slot] <= 1:  # decoding: only its last committed token is new
            continue
        if share_prefill(row, active, target):
            waiting.add(row)
            continue
        unseen = len(row.seq) - target.lengths[row.slot]
        if unseen > budget:
            if budget:
                parts[row] = budget
            else:
                waiting.add(row)
        budget -= min(budget, unseen)
    return [row for row in active if row not in parts and row not in waiting], parts


def share_prefill(row: Row, active: list[Row], target: Model) -> bool:
    """A row still being prefilled takes the longest prefix of its prompt another row's cache holds, or waits (True)
    while an older row, still being prefilled, feeds more of it. Gains under SHARED_PREFIX tokens are not worth a
    copy."""
    prompt = row.seq.ids
    best, donor = target.lengths[row.slot] + SHARED_PREFIX - 1, None
    for other in active:
        if other is row:
            continue
        cached = target.lengths[other.slot]
        common = min(common_prefix_length(other.seq.ids, prompt), len(prompt) - 1)
        if other.started < row.started and cached < common and len(other.seq) - cached > 1:
            if common > best:  # it feeds the shared prefix this round or a later one: copy it then
                return True
        elif min(common, cached) > best:
            best, donor = min(common, cached), other
    if donor is not None:
        target.copy(donor.slot, row.slot, best)
        row.result.stats.cached_tokens = best
    return False
