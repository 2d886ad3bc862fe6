"""The drafter protocol: what a round asks of a drafter, every member declared.

A drafter drafts for the slots of a decoding round (verispec.decoding.engine): a lone sequence is slot 0 of a
round of one. Before a round the engine asks where a slot's next draft would come from (`source`, so that a k
policy can learn each source apart) and how many committed tokens it must first catch up on (`pending`), feeds
them in a call it times (`catch_up`), then takes every drafting slot's draft at once (`propose`: a draft model
runs each step for all of them in one forward) and reports what each slot accepted (`observe`). A Draft
(verispec.core.draft) is what verification takes.

Free lookups (n-gram, suffix) draft one sequence at a time and cost no forward: they follow the smaller `Lookup`
protocol, and verispec.proposers.lookup gives each slot its own.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from verispec.core.draft import Draft
from verispec.core.grammar import GrammarRow
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence

# a round's request of one slot: (slot, its committed sequence, k, depth); a tree drafter reads k as its node budget
# and depth as the most draft forwards it may spend (None: its own maximum); a chain's depth is its k
DraftRow = tuple[int, TokenSequence, int, "int | None"]


class Drafter(Protocol):
    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              grammar: GrammarRow | None = None, texts: Sequence[Sequence[int]] = ()) -> None:
        """Slot `slot` starts drafting for a new sequence (a cache may keep what it shares with the slot's last).
        `grammar`: a constrained sequence's matcher (verispec.core.grammar), which a drafter may mask its draws by
        (exactness does not need it: the round masks p and walks every draft). `texts`: token texts besides the
        sequence that a lookup may copy from (the request's lookup_texts); a draft model reads the sequence only."""

    def source(self, slot: int, seq: TokenSequence) -> str:
        """The source the slot's next draft would come from ('none': no draft would be offered)."""

    def pending(self, slot: int, seq: TokenSequence) -> int:
        """Committed tokens to feed in a separate catch-up pass before the slot's next draft (0: none)."""

    def catch_up(self, slot: int, seq: TokenSequence, limit: int | None = None) -> int:
        """Feed up to `limit` (None: all) of the committed tokens the slot's next draft would otherwise feed in its
        catch-up pass; returns how many were fed. The engine times this call."""

    def propose(self, rows: list[DraftRow]) -> list[Draft]:
        """Each row's draft of at most k tokens (fewer, or none, when its source has no more), in row order. Its first
        step feeds whatever committed tokens the slot's cache has not seen: the engine catches a row up first
        (`pending`, `catch_up`: timed apart) so that the first step feeds only a few."""

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of the slot's `drafted` tokens were committed to `seq`."""

    def swap(self, a: int, b: int) -> None:
        """Slots a and b exchange their state (caches included), as the target's slots do."""

    def release(self, slot: int) -> None:
        """The slot's sequence is done (its final tokens are in its seq)."""

    def reset(self) -> None:
        """Forget every slot (caches)."""


class Lookup(Protocol):
    """A free drafter of one sequence at a time: it looks its drafts up (no forward, nothing to catch up on)."""

    def start(self, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              texts: Sequence[Sequence[int]] = ()) -> None:
        """A new generation begins on `seq`; `texts`: other token texts its drafts may copy from."""

    def source(self, seq: TokenSequence) -> str:
        """The source the next draft would come from ('none': no draft would be offered)."""

    def propose(self, seq: TokenSequence, k: int) -> Draft:
        """At most k draft tokens continuing `seq`."""

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of `drafted` tokens were committed to `seq`."""

    def end(self) -> None:
        """The generation is done (its final tokens are in its seq)."""

    def reset(self) -> None:
        """Forget this generation."""
