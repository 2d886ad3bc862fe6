"""One request being decoded (`Row`: what the engine keeps of it between rounds) and its part in one round (`Turn`)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from verispec.core.draft import Draft
from verispec.core.grammar import GrammarRow
from verispec.core.rows import TokenLogprob
from verispec.core.sequence import TokenSequence
from verispec.decoding.policies.base import KPolicy, Plan
from verispec.decoding.request import Committed, GenerationResult, Resolved, StopFn


@dataclass(eq=False)
class Row:
    """One request being decoded: its resolved request, k policy and stop test, and its slot, committed sequence,
    RNG and result (filled as rounds commit). `prefilled` once a round has fed its whole prompt; `done` once
    it finished or was cancelled."""

    request: Resolved
    policy: KPolicy
    stop: StopFn | None
    result: GenerationResult
    seq: TokenSequence
    rng: torch.Generator
    slot: int
    logprobs: list[TokenLogprob] | None = None
    grammar: GrammarRow | None = None  # the matcher of a constrained request (verispec.core.grammar)
    started: float = field(default_factory=time.perf_counter)
    prefilled: bool = False
    done: bool = False


def _no_seconds() -> float:
    return 0.0


@dataclass(eq=False)
class Turn:
    """One row's round, filled stage by stage: its plan; the draft's catch-up (tokens, and its seconds once the round
    has synced); the draft it asked for (`asked`: the policy's own, the drafter's, or none) and the one verified
    (`draft`: cut by the row's grammar); the committed tokens its cache had not seen (`unseen`); the outcome (the
    committed tokens, the drafts accepted, a tree's accepted path) and what it hands out (`chunk`)."""

    row: Row
    plan: Plan
    caught: int = 0
    catchup_seconds: Callable[[], float] = _no_seconds
    asked: Draft | None = None
    draft: Draft | None = None
    unseen: int = 0
    committed: list[int] = field(default_factory=list)
    accepted: int = 0
    path: list[int] = field(default_factory=list)
    chunk: Committed | None = None

    @property
    def asks(self) -> bool:
        """The drafter drafts for it: k > 0 and no draft of the policy's own."""
        return self.plan.draft is None and self.plan.k > 0

    @property
    def fed(self) -> int:
        """Tokens it fed to the round's target pass: the unseen committed ones and the draft."""
        return self.unseen + self.draft.tokens.numel()
