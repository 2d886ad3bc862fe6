"""A lean decode path for Llama-family drafts (Llama, Qwen2, Mistral without sliding window).

A draft runs one single-token forward per drafted token, so per-call overhead matters as much as the math.
In a small quantised draft's transformers step the matmuls are only part of the time; the rest is module
dispatch, mask building and a DynamicCache that concatenates every layer's keys and values each step. This module runs the same network from the same weights with far fewer calls per layer:
- q, k and v are one linear layer (their weights concatenated), gate and up another (fewer, larger matmuls,
  and quantisation packs the fused layers just as it does the separate ones);
- RoPE is one rotation of q and k together, from cos/sin tables the model's own rotary module computes once;
- the KV cache is preallocated per layer and written in place; rollback just moves the length (O(1)), and
  a single-token step needs no mask.
It is a draft: its numerics only have to be close to transformers' (they change acceptance, never the
verified distribution). tests/test_lean.py checks it against the transformers forward in fp32.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

LEAN_TYPES = ("llama", "qwen2", "mistral")
STATIC_ROPE = ("default", "linear", "llama3", "yarn")  # cos/sin depend on the position only
FIRST_CAPACITY = 1024  # cache positions allocated first; doubled when full


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
    """One nn.Linear computing the given layers' outputs side by side (missing biases are zeros)."""
    first = linears[0]
    weight = torch.cat([l.weight.detach() for l in linears])
    has_bias = any(l.bias is not None for l in linears)
    fused = nn.Linear(first.in_features, weight.shape[0], bias=has_bias, device=weight.device, dtype=weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(weight)
        if has_bias:
            fused.bias.copy_(torch.cat([l.bias.detach() if l.bias is not None
                                        else l.weight.new_zeros(l.out_features) for l in linears]))
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
                values: torch.Tensor, start: int, mask: torch.Tensor | None) -> torch.Tensor:
        """h: [1, n, D]; cos/sin: [n, 1, hd] (sin sign-folded); keys/values: [1, Hkv, capacity, hd]."""
        n, end, d = h.shape[1], start + h.shape[1], self.head_dim
        x = F.rms_norm(h, h.shape[-1:], self.norm1, self.eps)
        qkv = self.qkv(x)  # [1, n, (H + 2 Hkv) hd]
        qk = qkv[..., : (self.heads + self.kv_heads) * d].view(1, n, -1, d)
        qk = qk * cos + qk.roll(d // 2, -1) * sin  # RoPE on q and k at once
        q = qk[:, :, : self.heads].transpose(1, 2)  # [1, H, n, hd]
        keys[:, :, start:end] = qk[:, :, self.heads :].transpose(1, 2)
        values[:, :, start:end] = qkv[..., (self.heads + self.kv_heads) * d :].view(1, n, -1, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, keys[:, :, :end], values[:, :, :end], attn_mask=mask,
                                           scale=self.scale, enable_gqa=self.heads != self.kv_heads)
        h = h + self.o(o.transpose(1, 2).reshape(1, n, -1))
        gate, up = self.gate_up(F.rms_norm(h, h.shape[-1:], self.norm2, self.eps)).split(self.inter, dim=-1)
        return h + self.down(F.silu(gate) * up)


class LeanNet(nn.Module):
    """The network, rebuilt from a transformers model's modules (weights shared or fused, nothing retrained)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        reason = lean_unsupported(model)
        if reason is not None:
            raise ValueError(f"the lean draft path cannot run {reason}: use the transformers forward")
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


class LeanModel:
    """The Model protocol over a LeanNet: preallocated KV cache, O(1) rollback."""

    def __init__(self, model: nn.Module) -> None:
        self.net = LeanNet(model.eval())
        self.device = self.net.norm.device
        self.dtype = self.net.norm.dtype
        self.vocab_size, self.max_length = self.net.vocab_size, self.net.max_length
        self._length = 0
        self._capacity = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.cos = self.sin = torch.empty(0)

    @property
    def length(self) -> int:
        return self._length

    def _grow(self, needed: int) -> None:
        """Cache (and RoPE tables) for at least `needed` positions: doubles, copying what is held."""
        capacity = max(FIRST_CAPACITY, self._capacity)
        while capacity < needed:
            capacity *= 2
        capacity = min(capacity, self.max_length)
        shape = (1, self.net.kv_heads, capacity, self.net.head_dim)
        grown = []
        for old in (self.keys, self.values):
            new = [torch.empty(shape, device=self.device, dtype=self.dtype) for _ in self.net.layers]
            for a, b in zip(new, old):
                a[:, :, : self._length] = b[:, :, : self._length]
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
    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """tokens: [n] long on self.device -> logits [n, V] (or [1, V] with last_only)."""
        n, start = tokens.numel(), self._length
        end = start + n
        if end > self.max_length:
            raise ValueError(f"sequence of {end} tokens exceeds the model's context of {self.max_length}")
        if end > self._capacity:
            self._grow(end)
        mask = None
        if n > 1:  # row i sees the cache and new tokens up to itself
            mask = torch.ones(n, end, dtype=torch.bool, device=self.device).tril(start)
        cos, sin = self.cos[start:end], self.sin[start:end]
        h = self.net.embed(tokens).unsqueeze(0)  # [1, n, D]
        for layer, keys, values in zip(self.net.layers, self.keys, self.values):
            h = layer(h, cos, sin, keys, values, start, mask)
        if last_only:
            h = h[:, -1:]
        h = F.rms_norm(h, h.shape[-1:], self.net.norm, self.net.eps)
        self._length = end
        return self.net.head(h)[0]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._length}")
        self._length = length

    def reset(self) -> None:
        self._length = 0
