"""One request being decoded (`Row`: what the engine keeps of it between rounds) and a lone request's rounds as an
iterator (`Generation`)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from verispec.core.grammar import GrammarRow
from verispec.core.rows import TokenLogprob
from verispec.core.sequence import TokenSequence
from verispec.decoding.policies.base import KPolicy
from verispec.decoding.request import Committed, GenerationResult, Resolved, StopFn


@dataclass(eq=False)
class Row:
    """One request being decoded: its resolved request, k policy and stop test, and its slot, committed sequence,
    generator and result (filled as rounds commit). `prefilled` once a round has fed its whole prompt; `done` once
    it finished or was cancelled."""

    request: Resolved
    policy: KPolicy
    stop: StopFn | None
    result: GenerationResult
    seq: TokenSequence
    generator: torch.Generator
    slot: int
    logprobs: list[TokenLogprob] | None = None
    grammar: GrammarRow | None = None  # the matcher of a constrained request (verispec.core.grammar)
    started: float = field(default_factory=time.perf_counter)
    prefilled: bool = False
    done: bool = False


class Generation:
    """Iterate to get each round's newly committed tokens (`Committed`); `result` is filled as it goes.
    Closing the iterator early (a client went away) leaves the engine consistent."""

    def __init__(self, rounds: Iterator[Committed], result: GenerationResult) -> None:
        self._rounds = rounds
        self.result = result

    def __iter__(self) -> Iterator[Committed]:
        return self._rounds

    def close(self) -> None:
        self._rounds.close()  # type: ignore[attr-defined]
