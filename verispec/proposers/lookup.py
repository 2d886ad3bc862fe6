"""Free lookups (n-gram, suffix) as a drafter: each slot its own lookup. They cost no forward, so there is nothing to
batch: a round asks each drafting slot's lookup in turn. Lookups made by one factory may share state (the suffix
lookups of a process share its history of past outputs)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.core.draft import Draft
from verispec.core.grammar import GrammarRow
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.proposers.base import DraftRow, Lookup


def no_draft(seq: TokenSequence) -> Draft:
    """The empty draft of a round that decodes plainly."""
    return Draft(seq.device_ids.new_empty(0), None, "")


class LookupDrafter:
    """The Drafter over one Lookup per slot (`lookups[s]` drafts for slot s)."""

    def __init__(self, lookups: Sequence[Lookup]) -> None:
        self.lookups = list(lookups)

    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              grammar: GrammarRow | None = None, texts: Sequence[Sequence[int]] = ()) -> None:
        self.lookups[slot].start(seq, params, rng, texts)

    def source(self, slot: int, seq: TokenSequence) -> str:
        return self.lookups[slot].source(seq)

    def pending(self, slot: int, seq: TokenSequence) -> int:
        return 0  # free: nothing to catch up on

    def catch_up(self, slot: int, seq: TokenSequence, limit: int | None = None) -> int:
        return 0

    def propose(self, rows: list[DraftRow]) -> list[Draft]:
        return [self.lookups[slot].propose(seq, k) if k > 0 else no_draft(seq) for slot, seq, k, _ in rows]

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        self.lookups[slot].observe(seq, drafted, accepted)

    def swap(self, a: int, b: int) -> None:
        self.lookups[a], self.lookups[b] = self.lookups[b], self.lookups[a]

    def release(self, slot: int) -> None:
        self.lookups[slot].end()

    def reset(self) -> None:
        for lookup in self.lookups:
            lookup.reset()
