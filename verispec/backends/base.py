"""The Model protocol every backend implements: feed new tokens, get logits, roll back in O(1)."""

from __future__ import annotations

from typing import Protocol

import torch


class Model(Protocol):
    """A causal LM with one sequence's KV cache (batch size 1).

    `forward` appends `tokens` to the cache and returns their logits [n, V]; `rollback(n)` keeps the
    first n cached positions. `length` is the number of cached positions.
    """

    device: torch.device
    vocab_size: int
    max_length: int

    @property
    def length(self) -> int: ...

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor: ...

    def rollback(self, length: int) -> None: ...

    def reset(self) -> None: ...


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
