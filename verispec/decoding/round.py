"""What follows a row's commit in a round: `settle` books it, applies the stops and says what to hand out and whether
the generation ended. The round itself (draft, one target pass, verify, commit) stays with the engine
(verispec.decoding.engine), which owns the caches: on a stop it rolls the row's slot back to the kept tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass

from verispec.core.rows import TokenLogprob
from verispec.core.sequence import TokenSequence
from verispec.decoding.policies.base import RoundReport
from verispec.decoding.request import Committed, GenerationResult, Resolved, StopFn


@dataclass(frozen=True)
class Settled:
    """A settled round: the tokens to hand out (None: none), whether a stop cut the round (the sequence is
    truncated after the stop; the target's cache must follow) and whether the generation ended."""

    chunk: Committed | None
    cut: bool
    done: bool


def settle(seq: TokenSequence, committed: list[int], report: RoundReport, request: Resolved, result: GenerationResult,
           stop: StopFn | None, logprobs: list[TokenLogprob] | None, started: float) -> Settled:
    """Book a round that committed `committed` (already in seq) into `result`: its stats, the stop (an id in the
    request's stop ids, or `stop` on the generated ids) that ends it, max_new_tokens, the tokens and logprobs so
    far. `started`: when the generation started (perf_counter)."""
    stats = result.stats
    stats.add_round(report)
    emitted, keep = cut_at_stop(seq, committed, stop, request.stop_ids)
    cut, full = keep is not None, len(seq.generated) >= request.max_new_tokens
    if cut:
        stats.cut_round(report.drafted, report.accepted, len(emitted), None if report.tree is None else report.tree.depth)
        result.finish_reason = "stop"
    elif full:
        result.finish_reason = "length"
    result.token_ids = seq.generated
    result.logprobs = None if logprobs is None else logprobs[: len(result.token_ids)]
    stats.new_tokens, stats.seconds = len(result.token_ids), time.perf_counter() - started
    if emitted and not stats.first_token_seconds:
        stats.first_token_seconds = stats.seconds
    chunk = Committed(emitted, min(report.accepted, len(emitted))) if emitted else None
    return Settled(chunk, cut, cut or full)


def _stop_index(generated: list[int], start: int, stop: StopFn | None, stop_ids: frozenset[int]) -> int | None:
    """Number of generated tokens to keep if a stop (an id in stop_ids, or a stop string) was hit among
    generated[start:], else None."""
    keep = next((i + 1 for i in range(start, len(generated)) if generated[i] in stop_ids), None)
    if stop is not None:
        at_stop = stop(generated[:keep] if keep is not None else generated)
        if at_stop is not None:
            keep = at_stop
    return keep


def cut_at_stop(
    seq: TokenSequence, committed: list[int], stop: StopFn | None, stop_ids: frozenset[int]
) -> tuple[list[int], int | None]:
    """After a round committed `committed` (already in seq): if a stop was hit among them, truncate seq after
    it and return (the committed tokens kept, generated tokens kept); else (committed, None)."""
    start = len(seq.generated) - len(committed)
    keep = _stop_index(seq.generated, start, stop, stop_ids)
    if keep is None:
        return committed, None
    seq.truncate(seq.prompt_length + keep)
    return committed[: max(0, keep - start)], keep
