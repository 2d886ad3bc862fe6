"""The proposer protocol: what the engine asks of a drafter, every member declared.

A round asks the proposer where its next draft would come from (`source`, so that a k policy can learn
each source apart), how many committed tokens it must first catch up on (`pending`), feeds them in a
call the engine times (`catch_up`), then takes the draft (`propose`) and reports what was accepted
(`observe`). Free drafters (n-gram, suffix lookup) have nothing to catch up on: `pending` is 0 and
`catch_up` feeds nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence

if TYPE_CHECKING:
    from verispec.core.tree import TokenTree


@dataclass
class Draft:
    """Proposed tokens and the distribution they were drawn from."""

    tokens: torch.Tensor  # [k] long, on the target's device
    probs: torch.Tensor | None  # [k, V] q, or None: deterministic (q one-hot on tokens)
    source: str = "model"  # which source drafted it (a k policy learns per source)
    steps: int = 0  # draft-model forwards spent on it (0: a free drafter)
    tree: "TokenTree | None" = None  # the tokens' tree (parents, depths); None: a chain, tokens[i] after tokens[i-1]


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

    def propose(self, seq: TokenSequence, k: int) -> Draft:
        """At most k draft tokens continuing `seq` (fewer, or none, when the source has no more)."""

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of `drafted` tokens were committed to `seq`."""

    def reset(self) -> None:
        """Forget all state (caches)."""
