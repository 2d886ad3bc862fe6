"""The model protocols: what the decoding layer asks of a backend.

- Model: one sequence's KV cache; feed new tokens, get their logits, roll back in O(1). Every backend.
- TreeModel: a Model that also scores token trees in one pass (each node sees its ancestors) and keeps the
  accepted path. verispec's lean path (LeanModel).
- SlotModel: many sequences' caches at once, a length per slot: feed ragged rows in one pass, roll a slot back,
  move a slot. What a batch decodes on (LeanBatch).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

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


@runtime_checkable
class TreeModel(Model, Protocol):
    """A Model that verifies token trees: `forward_tree` appends n nodes (stored in the order given, at RoPE
    positions `positions` [n], the largest `last_position`) and returns their logits [n, V]; every node sees the
    cache before `base` and, of what lies from `base` on, the columns where visible[i] is True (its ancestors and
    itself). `keep(base, rows)` keeps after `base` only the rows base + rows[i] (ascending): the accepted path
    moves into place and the cache's length becomes base + len(rows)."""

    def forward_tree(self, tokens: torch.Tensor, positions: torch.Tensor, base: int, visible: torch.Tensor,
                     last_position: int) -> torch.Tensor: ...

    def keep(self, base: int, rows: list[int]) -> None: ...


class SlotModel(Protocol):
    """The caches of `slots` sequences, `lengths[s]` positions held by slot s. `forward_rows` appends feeds[b]
    (>= 1 token) to slot slots[b] for every row in one pass and returns each row's logits (of its last keep[b]
    tokens; default all; last_only: the last one); `rollback(slot, n)` keeps a slot's first n positions; `move`
    copies a slot's cache into another (which takes its length); `reset` forgets one slot, or all."""

    device: torch.device
    vocab_size: int
    max_length: int
    slots: int
    lengths: list[int]

    def forward_rows(self, slots: list[int], feeds: list[torch.Tensor], last_only: bool = False,
                     keep: list[int] | None = None) -> list[torch.Tensor]: ...

    def rollback(self, slot: int, length: int) -> None: ...

    def move(self, src: int, dst: int) -> None: ...

    def reset(self, slot: int | None = None) -> None: ...


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
