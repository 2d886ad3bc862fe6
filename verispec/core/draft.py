"""A draft: the tokens a drafter proposes for one round, with the distribution they were drawn from."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from verispec.names.drafters import Source

if TYPE_CHECKING:
    from verispec.core.tree import TokenTree


@dataclass
class Draft:
    """Proposed tokens and the distribution they were drawn from."""

    tokens: torch.Tensor  # [k] long, on the target's device
    probs: torch.Tensor | None  # [k, V] q, or None: deterministic (q one-hot on tokens)
    source: str = Source.MODEL  # which source drafted it (a k policy learns per source)
    steps: int = 0  # draft-model forwards spent on it (0: a free drafter)
    tree: "TokenTree | None" = None  # the tokens' tree (parents, depths); None: a chain, tokens[i] after tokens[i-1]
