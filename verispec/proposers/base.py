"""The proposer protocol: what the engine asks of a drafter, every member declared.

A round asks the proposer where its next draft would come from (`source`, so that a k policy can learn
each source apart), how many committed tokens it must first catch up on (`pending`), feeds them in a
call the engine times (`catch_up`), then takes the draft (`propose`) and reports what was accepted
(`observe`). Free drafters (n-gram, suffix lookup) have nothing to catch up on: `pending` is 0 and
`catch_up` feeds nothing. A Draft (verispec.core.draft) is what verification takes.
"""

from __future__ import annotations

from typing import Protocol

import torch

from verispec.core.draft import Draft
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence


class Proposer(Protocol):
    def start(self, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        """A new generation begins on `seq` (may reuse state from a previous one with a common prefix)."""

    def source(self, seq: TokenSequence) -> str:
        """The source the next draft for `seq` would come from ('none': no draft would be offered)."""

    def pending(self, seq: TokenSequence) -> int:
        """Committed tokens the next draft must first feed in a separate catch-up pass (0: none)."""

    def catch_up(self, seq: TokenSequence, limit: int | None = None) -> int:
        """Feed up to `limit` (None: all) of the committed tokens the next draft would otherwise feed in
        its catch-up pass; returns how many were fed. The engine times this call."""

    def propose(self, seq: TokenSequence, k: int, depth: int | None = None) -> Draft:
        """At most k draft tokens continuing `seq` (fewer, or none, when the source has no more). A tree
        drafter reads k as its node budget and `depth` as the most draft forwards it may spend (None: its
        own maximum); a chain drafter's depth is its k, and it ignores `depth`."""

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of `drafted` tokens were committed to `seq`."""

    def reset(self) -> None:
        """Forget all state (caches)."""
