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
    far (`result.token_ids` grows with the round's tokens, `result.logprobs` is `logprobs` itself: a round costs
    what its tokens cost, however long the generation). `started`: when the generation started (perf_counter)."""
    stats, tokens = result.stats, result.token_ids
    stats.add_round(report)
    start = len(tokens)
    tokens.extend(committed)
    result.logprobs = logprobs
    keep = _stop_index(tokens, start, stop, request.stop_ids)
    emitted, cut = committed, keep is not None
    if cut:  # what follows the stop goes
        seq.truncate(seq.prompt_length + keep)
        del tokens[keep:]
        if logprobs is not None:
            del logprobs[keep:]
        emitted = committed[: max(0, keep - start)]
        stats.cut_round(report.drafted, report.accepted, len(emitted), None if report.tree is None else report.tree.depth)
        result.finish_reason = "stop"
    full = len(tokens) >= request.max_new_tokens
    if full and not cut:
        result.finish_reason = "length"
    stats.new_tokens, stats.seconds = len(tokens), time.perf_counter() - started
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
