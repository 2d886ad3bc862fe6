"""The model protocol: what the decoding layer asks of a backend.

- Model: a causal LM with the KV caches of `slots` sequences, a length per slot. One pass feeds ragged rows (each
  row its own slot, tokens and positions), a slot rolls back in O(1), two slots swap their caches. A lone
  sequence is slot 0 of a one-slot model. Every backend: transformers (one slot), the lean path and llama.cpp
  (any number).
- TreeModel: a Model that also scores a token tree in one pass (each node sees its ancestors) and keeps the
  accepted path. verispec's lean path.

`Sequence` gives one slot the single-sequence view (forward, rollback, length) that measurements and warm-ups use.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch


class Model(Protocol):
    """The caches of `slots` sequences, `lengths[s]` positions held by slot s. `forward_rows` appends feeds[b]
    (>= 1 token, 1-D long on `device`) to slot slots[b] for every row in one pass and returns each row's logits
    [logits_for[b], V], of its last logits_for[b] tokens (default all; last_only: the last one; 0: none, for a
    prompt fed in parts); `rollback(slot, n)` keeps a slot's first n positions; `swap(a, b)`: slots a and b
    exchange their caches and lengths; `copy(src, dst, n)`: slot dst's cache becomes the first n positions of
    src's (a prompt computed once for several sequences); `reset` forgets one slot, or all. `max_length` is the
    context of each slot."""

    device: torch.device
    vocab_size: int
    max_length: int
    slots: int
    lengths: list[int]

    def forward_rows(self, slots: list[int], feeds: list[torch.Tensor], last_only: bool = False,
                     logits_for: list[int] | None = None) -> list[torch.Tensor]: ...

    def rollback(self, slot: int, length: int) -> None: ...

    def swap(self, a: int, b: int) -> None: ...

    def copy(self, src: int, dst: int, length: int) -> None: ...

    def reset(self, slot: int | None = None) -> None: ...


@runtime_checkable
class TreeModel(Model, Protocol):
    """A Model that verifies token trees: `forward_tree` appends n nodes to a slot (stored in the order given, at
    RoPE positions `positions` [n], the largest `last_position`) and returns their logits [n, V]; every node sees
    the slot's cache before `base` and, of what lies from `base` on, the columns where visible[i] is True (its
    ancestors and itself). `compact(slot, base, rows)` keeps after `base` only the rows base + rows[i]
    (ascending), moved to base, base + 1, ...: the accepted path moves into place and the slot's length becomes
    base + len(rows)."""

    def forward_tree(self, slot: int, tokens: torch.Tensor, positions: torch.Tensor, base: int,
                     visible: torch.Tensor, last_position: int) -> torch.Tensor: ...

    def compact(self, slot: int, base: int, rows: list[int]) -> None: ...


def check_copy(model: Model, src: int, dst: int, length: int) -> None:
    """ValueError unless `copy(src, dst, length)` names two distinct slots and src holds `length` positions."""
    if src == dst or not (0 <= src < model.slots and 0 <= dst < model.slots):
        raise ValueError(f"copy needs two distinct slots of the model's {model.slots}, got {src} -> {dst}")
    if not 0 <= length <= model.lengths[src]:
        raise ValueError(f"cannot copy {length} positions: slot {src} holds {model.lengths[src]}")


def check_rows(model: Model, slots: list[int], feeds: list[torch.Tensor], last_only: bool,
               logits_for: list[int] | None) -> list[int]:
    """How many of its last tokens each row of a `forward_rows` call returns logits for, after checking the call
    (ValueError): slots in range and distinct, every row fed >= 1 token and keeping the logits of at most those,
    the context not exceeded."""
    sizes = [f.numel() for f in feeds]
    if last_only and logits_for is not None:
        raise ValueError("give last_only or logits_for, not both")
    counts = [1] * len(sizes) if last_only else list(sizes) if logits_for is None else list(logits_for)
    if (len(slots) != len(sizes) or len(counts) != len(sizes) or not sizes or min(sizes) < 1
            or any(not 0 <= k <= size for k, size in zip(counts, sizes))):
        raise ValueError(f"every row of a pass needs at least one token and keeps at most those; got {sizes} fed, "
                         f"{counts} kept for slots {slots}")
    if len(set(slots)) != len(slots) or not all(0 <= s < model.slots for s in slots):
        raise ValueError(f"slots {slots} are not distinct slots of the model's {model.slots}")
    longest = max(model.lengths[s] + size for s, size in zip(slots, sizes))
    if longest > model.max_length:
        raise ValueError(f"sequence of {longest} tokens exceeds the model's context of {model.max_length}")
    return counts


class Sequence:
    """One slot of a Model seen as a single sequence: `forward(tokens)` appends and returns their logits [n, V]
    (last_only: [1, V]), `rollback(n)`, `length`, `reset()`."""

    def __init__(self, model: Model, slot: int = 0) -> None:
        self.model, self.slot = model, slot
        self.device, self.vocab_size, self.max_length = model.device, model.vocab_size, model.max_length

    @property
    def length(self) -> int:
        return self.model.lengths[self.slot]

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        return self.model.forward_rows([self.slot], [tokens], last_only=last_only)[0]

    def rollback(self, length: int) -> None:
        self.model.rollback(self.slot, length)

    def reset(self) -> None:
        self.model.reset(self.slot)


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (a prompt and its own continuation), compared at C speed
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i
