"""A lean decode path for Llama-family models (Llama, Qwen2, Mistral without sliding window), one sequence
or many.

A draft runs one single-token forward per drafted token, so per-call overhead matters as much as the math.
In a small quantised draft's transformers step the matmuls are only part of the time; the rest is module
dispatch, mask building and a DynamicCache that concatenates every layer's keys and values each step. This
module runs the same network from the same weights with far fewer calls per layer:
- q, k and v are one linear layer (their weights concatenated), gate and up another (fewer, larger matmuls,
  and quantisation packs the fused layers just as it does the separate ones);
- RoPE is one rotation of q and k together, from cos/sin tables the model's own rotary module computes once;
- the KV cache is preallocated per layer and written in place; rollback just moves the length (O(1)), and
  a single-token step needs no mask.

Many sequences (`LeanBatch`, for batched speculation): one padded cache per layer, [slots, Hkv, capacity, hd],
and one length per slot. A forward feeds each row its own tokens at explicit positions length_b + j; row b's
query j sees cache positions t <= length_b + j and nothing else, so what lies past a slot's length (padding,
rejected drafts) is never read and a ragged rollback is one integer per slot, O(1), with no copy. Rows of
about one length are padded to the longest and attend in one call; ragged rows (a prompt being prefilled
beside rows of a few drafts) are packed side by side into one sequence instead, so the linear layers, most
of the cost, see no padding, and each row attends to its own slot in a call of its own. A padded cache
wastes at most the longest row's padding per round (a few tokens); a paged cache would save that memory at
the price of a gather per layer, which on a CPU costs more than the attention itself at these lengths.
Slots need not be contiguous: active slots are gathered (a copy) unless they form one range, which the
batch engine keeps them in.

Numerics only have to be close to transformers' for a draft; a target run here is the same network, and
tests/test_lean.py checks both against the transformers forward in fp32.
"""

from __future__ import annotations

import itertools

import torch
from torch import nn
from torch.nn import functional as F

from verispec.backends.base import check_copy, check_rows
from verispec.core.timing import device_tensor

LEAN_TYPES = ("llama", "qwen2", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
FIRST_CAPACITY = 1024  # cache positions allocated first; doubled when full
# rows are packed, not padded, when padding would add over a quarter of the tokens fed and at least
# PACKED_MIN_PADDING token rows (a few rows more cost little in a matmul; B attention calls cost more)
PACKED_WHEN_PADDING = 4
PACKED_MIN_PADDING = 16


def lean_unsupported(model: nn.Module) -> str | None:
    """Why `model` cannot run on the lean path, or None when it can."""
    config = model.config
    kind = getattr(config, "model_type", None)
    if kind not in LEAN_TYPES:
        return f"model type '{kind}' (the lean path runs {', '.join(LEAN_TYPES)})"
    if getattr(config, "use_sliding_window", False) or (kind == "mistral" and getattr(config, "sliding_window", None)):
        return "sliding-window attention"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation '{config.hidden_act}'"
    rope = (getattr(config, "rope_parameters", None) or {}).get("rope_type", "default")
    if rope not in STATIC_ROPE:
        return f"RoPE type '{rope}'"
    layer = model.model.layers[0]
    if getattr(layer.mlp, "gate_proj", None) is None or getattr(layer.self_attn, "q_proj", None) is None:
        return "an unfamiliar layer layout"
    return None


def _fuse(*linears: nn.Linear) -> nn.Linear:
    """One linear layer computing the given layers' outputs side by side (missing biases are zeros), of the
    first one's class (an OrientedLinear stays one)."""
    first = linears[0]
    weight = torch.cat([l.weight.detach() for l in linears])
    has_bias = any(l.bias is not None for l in linears)
    # made on the meta device (no random initialisation of a weight about to be replaced), then given the tensors
    fused = type(first)(first.in_features, weight.shape[0], bias=has_bias, device="meta", dtype=weight.dtype)
    fused.weight = nn.Parameter(weight, requires_grad=False)
    if has_bias:
        fused.bias = nn.Parameter(torch.cat([l.bias.detach() if l.bias is not None
                                             else l.weight.new_zeros(l.out_features) for l in linears]),
                                  requires_grad=False)
    return fused


class LeanLayer(nn.Module):
    def __init__(self, layer: nn.Module, heads: int, kv_heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        attn, mlp = layer.self_attn, layer.mlp
        self.qkv = _fuse(attn.q_proj, attn.k_proj, attn.v_proj)
        self.o = attn.o_proj
        self.gate_up = _fuse(mlp.gate_proj, mlp.up_proj)
        self.down = mlp.down_proj
        self.norm1 = layer.input_layernorm.weight
        self.norm2 = layer.post_attention_layernorm.weight
        self.heads, self.kv_heads, self.head_dim, self.eps = heads, kv_heads, head_dim, eps
        self.scale = float(getattr(attn, "scaling", head_dim ** -0.5))
        self.inter = mlp.gate_proj.out_features

    def forward(self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
                values: torch.Tensor, attend: "_Padded | _Packed") -> torch.Tensor:
        """h: [B, n, D]; cos/sin: [B, n, 1, hd] (sin sign-folded); keys/values: [slots, Hkv, capacity, hd]."""
        B, n, d = h.shape[0], h.shape[1], self.head_dim
        x = F.rms_norm(h, h.shape[-1:], self.norm1, self.eps)
        qkv = self.qkv(x)  # [B, n, (H + 2 Hkv) hd]
        qk = qkv[..., : (self.heads + self.kv_heads) * d].view(B, n, -1, d)
        qk = qk * cos + qk.roll(d // 2, -1) * sin  # RoPE on q and k at once
        v = qkv[..., (self.heads + self.kv_heads) * d :].view(B, n, -1, d)
        o = attend(qk[:, :, : self.heads], qk[:, :, self.heads :], v, keys, values, self.scale)  # [B, n, H hd]
        h = h + self.o(o)
        gate, up = self.gate_up(F.rms_norm(h, h.shape[-1:], self.norm2, self.eps)).split(self.inter, dim=-1)
        return h + self.down(F.silu(gate) * up)


class LeanNet(nn.Module):
    """The network, rebuilt from a transformers model's modules (weights shared or fused, nothing retrained)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean path cannot run {reason}: use the transformers forward")
        config, base = model.config, model.model
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        eps = config.rms_norm_eps
        self.embed = base.embed_tokens
        self.layers = nn.ModuleList(LeanLayer(layer, heads, kv_heads, head_dim, eps) for layer in base.layers)
        self.norm = base.norm.weight
        self.head = model.get_output_embeddings()
        self.rotary = base.rotary_emb
        self.kv_heads, self.head_dim, self.eps = kv_heads, head_dim, eps
        self.vocab_size = int(getattr(self.head, "vocab_size", None) or self.head.weight.shape[0])
        self.max_length = int(getattr(config, "max_position_embeddings", None) or 1 << 31)


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """q: [B, n, H, hd]; k, v: [B, Hkv, T, hd] -> [B, n, H hd]."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[2] != k.shape[1])
    return o.transpose(1, 2).reshape(q.shape[0], q.shape[1], -1)


class _Padded:
    """Attention for rows padded to one length n: where their new keys and values go, and one attention over
    the cache rows each query may see.

    One row (every single-sequence forward): a slice write and a view. Several rows: one indexed write per
    layer at [slot_b, :, positions[b, j]], and a view of the slots when they are one range (else a gather)."""

    def __init__(self, slots: list[int], start: int, positions: torch.Tensor | None, end: int,
                 mask: torch.Tensor | None) -> None:
        self.slots, self.start, self.positions, self.end, self.mask = slots, start, positions, end, mask
        self.first, self.last = slots[0], slots[-1] + 1
        self.contiguous = slots == list(range(self.first, self.last))
        self.index = None if positions is None else device_tensor(slots, positions.device)

    def __call__(self, q, k_new, v_new, keys, values, scale):  # q: [B, n, H, hd]; k_new, v_new: [B, n, Hkv, hd]
        end = self.end
        if self.positions is None:
            s = self.first
            keys[s : s + 1, :, self.start : end] = k_new.transpose(1, 2)
            values[s : s + 1, :, self.start : end] = v_new.transpose(1, 2)
            return _sdpa(q, keys[s : s + 1, :, :end], values[s : s + 1, :, :end], self.mask, scale)
        rows = self.index[:, None]
        keys[rows, :, self.positions] = k_new
        values[rows, :, self.positions] = v_new
        if self.contiguous:
            k, v = keys[self.first : self.last, :, :end], values[self.first : self.last, :, :end]
        else:
            k, v = keys[self.index, :, :end], values[self.index, :, :end]
        return _sdpa(q, k, v, self.mask, scale)


class _Packed:
    """Attention for ragged rows packed side by side into one sequence of T tokens ([1, T, ...]), so that
    the linear layers see no padding: row b's tokens are packed[offset_b : offset_b + size_b]; each row
    writes its slot's cache with a slice and attends to that slot alone, exactly as it would alone."""

    def __init__(self, slots: list[int], lengths: list[int], sizes: list[int], device: torch.device) -> None:
        self.rows, at = [], 0
        for slot, start, size in zip(slots, lengths, sizes):
            mask = torch.ones(size, start + size, dtype=torch.bool, device=device).tril(start) if size > 1 else None
            self.rows.append((slot, start, at, size, mask))
            at += size

    def __call__(self, q, k_new, v_new, keys, values, scale):  # q: [1, T, H, hd]; k_new, v_new: [1, T, Hkv, hd]
        out = []
        for slot, start, at, size, mask in self.rows:
            end = start + size
            keys[slot, :, start:end] = k_new[0, at : at + size].transpose(0, 1)
            values[slot, :, start:end] = v_new[0, at : at + size].transpose(0, 1)
            out.append(_sdpa(q[:, at : at + size], keys[slot : slot + 1, :, :end], values[slot : slot + 1, :, :end],
                             mask, scale))
        return torch.cat(out, dim=1)


class LeanBatch:
    """A LeanNet with `slots` sequences' KV caches: each slot its own length, rollback O(1) per slot."""

    def __init__(self, net: LeanNet, slots: int = 1) -> None:
        self.net = net
        self.device = net.norm.device
        self.dtype = net.norm.dtype
        self.vocab_size, self.max_length = net.vocab_size, net.max_length
        self.slots = slots
        self.lengths = [0] * slots
        self._capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cos = self.sin = torch.empty(0)

    def _grow(self, needed: int) -> None:
        """Cache (and RoPE tables) for at least `needed` positions: doubles, copying what is held."""
        capacity = max(FIRST_CAPACITY, self._capacity)
        while capacity < needed:
            capacity *= 2
        capacity = max(needed, min(capacity, self.max_length))  # padding may reach past max_length
        shape = (self.slots, self.net.kv_heads, capacity, self.net.head_dim)
        held = max(self.lengths)
        grown = []
        for old in (self.keys, self.values):
            # zeros, not empty: a row's masked positions still meet the values (weight 0), and 0 * NaN = NaN
            new = [torch.zeros(shape, device=self.device, dtype=self.dtype) for _ in self.net.layers]
            for a, b in zip(new, old):
                a[:, :, :held] = b[:, :, :held]
            grown.append(new)
        self.keys, self.values = grown
        positions = torch.arange(capacity, device=self.device).unsqueeze(0)
        probe = torch.empty(0, device=self.device, dtype=self.dtype)
        cos, sin = self.net.rotary(probe, positions)  # [1, capacity, hd], the model's own RoPE
        half = self.net.head_dim // 2
        sin = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's sign, folded in
        self.cos, self.sin = cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [capacity, 1, hd]
        self._capacity = capacity

    @torch.inference_mode()
    def forward_rows(self, slots: list[int], feeds: list[torch.Tensor], last_only: bool = False,
                     logits_for: list[int] | None = None) -> list[torch.Tensor]:
        """Append feeds[b] (1-D long, >= 1 token) to slot slots[b]'s cache, all rows in one forward; returns
        the logits of each row's last logits_for[b] tokens, [logits_for[b], V] (default: all of its tokens;
        last_only: the last one). A row with logits_for[b] = 0 (a prompt fed in parts) gets [0, V] and costs no
        LM head."""
        logits_for = check_rows(self, slots, feeds, last_only, logits_for)
        lengths = [self.lengths[s] for s in slots]
        sizes = [f.numel() for f in feeds]
        too_long = max(length + size for length, size in zip(lengths, sizes))
        B, n, fed = len(slots), max(sizes), sum(sizes)
        padding = B * n - fed
        packed = B > 1 and padding >= PACKED_MIN_PADDING and padding * PACKED_WHEN_PADDING > fed
        end = too_long if packed else max(length + n for length in lengths)
        if end > self._capacity:
            self._grow(end)
        if packed:  # one sequence of the rows side by side: token t of row b sits at length_b + t
            place = device_tensor([p for length, size in zip(lengths, sizes) for p in range(length, length + size)],
                                  self.device)
            tokens, cos, sin = torch.cat(feeds)[None], self.cos[place][None], self.sin[place][None]
            attend = _Packed(slots, lengths, sizes, self.device)
            starts = [0] + list(itertools.accumulate(sizes))[:-1]
        elif B == 1:  # one sequence: contiguous positions, slices
            start = lengths[0]
            tokens, cos, sin = feeds[0][None], self.cos[start:end][None], self.sin[start:end][None]  # [1, n, 1, hd]
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start) if n > 1 else None
            attend, starts = _Padded(slots, start, None, end, mask), [0]
        else:  # row b's query j sits at position length_b + j and sees cache positions t <= it
            positions = device_tensor(lengths, self.device)[:, None] + torch.arange(n, device=self.device)
            tokens = torch.stack([f if f.numel() == n else torch.cat([f, f[-1:].expand(n - f.numel())])
                                  for f in feeds])  # [B, n]; padding past a row's end
            cos, sin = self.cos[positions], self.sin[positions]  # [B, n, 1, hd]
            mask = (torch.arange(end, device=self.device) <= positions[..., None]).unsqueeze(1)  # [B, 1, n, end]
            attend, starts = _Padded(slots, 0, positions, end, mask), [b * n for b in range(B)]
        h = self.net.embed(tokens)  # [B, n, D] or [1, T, D]
        for layer, keys, values in zip(self.net.layers, self.keys, self.values):
            h = layer(h, cos, sin, keys, values, attend)
        for s, size in zip(slots, sizes):
            self.lengths[s] += size
        if not sum(logits_for):
            return [h.new_empty(0, self.vocab_size) for _ in logits_for]
        flat = h.view(-1, h.shape[-1])
        if logits_for != sizes or flat.shape[0] != fed:  # only the tokens with logits asked for meet the LM head
            kept = [start + size - k + j for start, size, k in zip(starts, sizes, logits_for) for j in range(k)]
            flat = flat[device_tensor(kept, self.device)]
        logits = self.net.head(F.rms_norm(flat, flat.shape[-1:], self.net.norm, self.net.eps))  # [sum(logits_for), V]
        return list(logits.split(logits_for))

    @torch.inference_mode()
    def forward_tree(self, slot: int, tokens: torch.Tensor, positions: torch.Tensor, base: int,
                     visible: torch.Tensor, last_position: int) -> torch.Tensor:
        """Append n >= 1 tree nodes to slot `slot`'s cache (stored in the order given, at positions `positions`
        [n] for RoPE, the largest `last_position`, given by the caller so as not to read it off the device) and
        return their logits [n, V]. Every node sees the cache before `base` (the committed sequence); of what
        lies from `base` on (nodes appended earlier, then these), node i sees the columns where visible[i]
        [length - base + n] is True: its ancestors and itself."""
        n, start = tokens.numel(), self.lengths[slot]
        end = start + n
        if n < 1 or not 0 <= base <= start or visible.shape != (n, end - base):
            raise ValueError(f"a tree pass needs nodes, a base within the cache ({start}) and visible [n, "
                             f"{end - base}]; got {n} nodes, base {base}, visible {list(visible.shape)}")
        if last_position >= self.max_length:
            raise ValueError(f"a tree node at position {last_position} exceeds the model's context of "
                             f"{self.max_length}")
        if end > self._capacity:
            self._grow(end)
        mask = torch.ones(n, end, dtype=torch.bool, device=self.device)
        mask[:, base:] = visible
        cos, sin = self.cos[positions][None], self.sin[positions][None]  # [1, n, 1, hd]
        attend = _Padded([slot], start, None, end, mask[None, None])
        h = self.net.embed(tokens[None])
        for layer, keys, values in zip(self.net.layers, self.keys, self.values):
            h = layer(h, cos, sin, keys, values, attend)
        logits = self.net.head(F.rms_norm(h, h.shape[-1:], self.net.norm, self.net.eps))[0]
        self.lengths[slot] = end
        return logits

    @torch.inference_mode()
    def compact(self, slot: int, base: int, rows: list[int]) -> None:
        """Keep, after `base`, only the cached rows base + rows[i] (in that order, rows ascending): the path a
        tree verification accepted moves to base, base + 1, ...; the slot's length becomes base + len(rows)."""
        held = self.lengths[slot] - base
        if held < 0 or any(b <= a for a, b in zip(rows, rows[1:])) or (rows and not 0 <= rows[0] <= rows[-1] < held):
            raise ValueError(f"rows {rows} are not ascending rows of the {held} held after {base}")
        moved = [i for i, r in enumerate(rows) if r != i]
        if moved:
            src = device_tensor([base + rows[i] for i in moved], self.device)
            dst = device_tensor([base + i for i in moved], self.device)
            for cache in (*self.keys, *self.values):
                cache[slot, :, dst] = cache[slot, :, src]
        self.lengths[slot] = base + len(rows)

    def rollback(self, slot: int, length: int) -> None:
        if not 0 <= length <= self.lengths[slot]:
            raise ValueError(f"cannot roll back to {length}: cache holds {self.lengths[slot]}")
        self.lengths[slot] = length

    @torch.inference_mode()
    def swap(self, a: int, b: int) -> None:
        """Slots a and b exchange their caches (what each holds, copied) and lengths."""
        if a == b:
            return
        held_a, held_b = self.lengths[a], self.lengths[b]
        for cache in (*self.keys, *self.values):
            kept = cache[a, :, :held_a].clone()
            cache[a, :, :held_b] = cache[b, :, :held_b]
            cache[b, :, :held_a] = kept
        self.lengths[a], self.lengths[b] = held_b, held_a

    @torch.inference_mode()
    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot dst's cache becomes the first `length` positions of src's (copied on the device)."""
        check_copy(self, src, dst, length)
        for cache in (*self.keys, *self.values):
            cache[dst, :, :length] = cache[src, :, :length]
        self.lengths[dst] = length

    def reset(self, slot: int | None = None) -> None:
        """Forget one slot's cache, or all."""
        for s in range(self.slots) if slot is None else (slot,):
            self.lengths[s] = 0

    def with_slots(self, slots: int) -> LeanBatch:
        """A LeanBatch of `slots` sequences on the same net (the weights shared, caches of its own)."""
        batch = LeanBatch(self.net, slots)
        batch.max_length = self.max_length
        return batch
