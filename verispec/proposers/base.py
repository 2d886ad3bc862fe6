"""The Proposer protocol: propose k draft tokens for the committed sequence."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from verispec.sampling import SamplingParams
from verispec.sequence import TokenSequence


@dataclass
class Draft:
    tokens: torch.Tensor  # [k] long, on the target's device
    probs: torch.Tensor | None  # [k, V] q, or None: deterministic (q one-hot on tokens)


class Proposer(Protocol):
    def start(self, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        """A new generation begins on `seq` (may reuse state from a previous one with a common prefix)."""

    def propose(self, seq: TokenSequence, k: int) -> Draft: ...

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of `drafted` tokens were committed to `seq`."""

    def reset(self) -> None:
        """Forget all state (caches)."""
