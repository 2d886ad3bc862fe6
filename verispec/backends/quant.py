"""Weight-only int8 / int4 quantisation for the draft model (the target is never quantised).

Draft precision changes only how often drafts are accepted, never the output distribution: the verifier
uses the target's full-precision p, and q is whatever distribution the (quantised) draft sampled from.
On CPU the matmuls run in PyTorch's packed kernels (`_weight_int8pack_mm`: int8 weights with per-output-
channel scales; `_weight_int4pack_mm_for_cpu`: 4-bit weights with a scale and offset per group of
INT4_GROUP input channels), always with bf16 activations (their float32 path is 10-30x slower; a float32
draft casts its rows to bf16 and back); elsewhere the weights are dequantised on the fly.
The packed kernels are matrix-vector kernels: their cost grows with the rows, bf16's barely does up to ~16
rows. So on CPU a quantised layer keeps its bf16 weights too and uses them for batches over
PACKED_MAX_ROWS rows (prefill, catch-up): decoding runs at int speed, prefill at bf16 speed, at the price of
the extra memory. A batched draft step (verispec.proposers.draft_model) runs in forwards of at most PACKED_MAX_ROWS rows,
because the packed kernels compute each row alone, bitwise the same whatever the other rows: a sequence's
q, and so its seeded draws, never depend on its batch mates. The rows chosen never
change which distribution is verified: q is whatever the draft computed.
"""

from __future__ import annotations

import torch
from torch import nn

from verispec.backends.linear import linear
from verispec.names.drafters import QUANT_MODES

INT4_GROUP = 32  # input channels sharing one scale/offset (the kernel takes 32, 64, 128 or 256)
PACKED_MAX_ROWS = 16  # larger batches use the bf16 weights (see above)


def packed_dtype(device: torch.device, dtype: torch.dtype) -> torch.dtype:
    """The dtype the packed kernels compute in for activations of `dtype` on `device`: bf16 on a CPU (their
    float32 path is 10-30x slower than their bf16 one), else the activations' own."""
    return torch.bfloat16 if device.type == "cpu" else dtype


class _PackedLinear(nn.Module):
    """Shared by the int8 and int4 layers: small batches go to `_packed`, large ones (CPU) to the kept float
    weights, then bias and shape. The float weights are the original tensor, not a copy (a tied LM head keeps
    sharing it with the embedding)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach())
        dense = linear.weight.detach() if linear.weight.device.type == "cpu" else None
        self.register_buffer("dense", dense)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:  # [n, in] -> [n, out], no bias
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if self.dense is not None and flat.shape[0] > PACKED_MAX_ROWS:
            y = linear(flat, self.dense, self.bias)
        else:
            y = self._packed(flat.to(packed_dtype(flat.device, flat.dtype))).to(flat.dtype)
            if self.bias is not None:
                y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int8Linear(_PackedLinear):
    """y = x @ (scale[:, None] * w_int8).T + b, symmetric per-output-channel int8 weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        w = linear.weight.detach().float()
        # the largest |w| per row without a |w| copy; the codes in one temporary the size of the weight
        scales = torch.linalg.vector_norm(w, ord=float("inf"), dim=1).clamp_min(1e-8) / 127.0  # [out]
        codes = (w / scales[:, None]).round_().clamp_(-127, 127)
        self.register_buffer("weight", codes.to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        scales = self.scales.to(flat.dtype)
        if flat.device.type == "cpu":
            return torch._weight_int8pack_mm(flat, self.weight, scales)
        return flat @ (self.weight.to(flat.dtype) * scales[:, None]).T


class Int4Linear(_PackedLinear):
    """Asymmetric 4-bit weights per group of INT4_GROUP input channels: w = q * scale + low, q in 0..15."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear)
        w = linear.weight.detach().float()  # [out, in]
        out_f, in_f = w.shape
        groups = w.reshape(out_f, in_f // INT4_GROUP, INT4_GROUP)
        low = groups.amin(dim=-1, keepdim=True)
        scale = ((groups.amax(dim=-1, keepdim=True) - low) / 15).clamp_min(1e-8)
        q = torch.round((groups - low) / scale).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
        dtype = linear.weight.dtype
        scale, low = scale.squeeze(-1), low.squeeze(-1)  # [out, in / G]
        self.cpu = w.device.type == "cpu"
        if self.cpu:  # the kernel computes (q - 8) * scale + zero
            self.register_buffer("weight", torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))
            zero = low + 8 * scale
            # rounded to the weights' dtype, then kept in the kernel's: a float32 model would otherwise
            # convert its [out, in / G] scales and zeros on every call
            self.register_buffer("scales_zeros", torch.stack([scale.T, zero.T], dim=-1).to(dtype)
                                 .to(packed_dtype(w.device, dtype)).contiguous())
        else:  # [out, in] as uint8 codes, dequantised per call
            self.register_buffer("weight", q.to(torch.uint8))
            self.register_buffer("scales_zeros", torch.stack([scale, low], dim=-1).to(dtype))

    def _packed(self, flat: torch.Tensor) -> torch.Tensor:
        if self.cpu:
            return torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.weight, INT4_GROUP,
                                                               self.scales_zeros.to(flat.dtype))  # already flat's
        scale, low = self.scales_zeros.to(flat.dtype).unbind(-1)  # [out, in / G] each
        codes = self.weight.to(flat.dtype).view(self.out_features, -1, INT4_GROUP)
        return flat @ (codes * scale[..., None] + low[..., None]).view(self.out_features, self.in_features).T


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace every nn.Linear (attention, MLP, LM head) with its quantised version, in place. int4 leaves
    a layer in its original precision when the packed kernel cannot take its shape (input width not a
    multiple of INT4_GROUP, output width not a multiple of 16)."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantisation '{mode}' (use {', '.join(QUANT_MODES)})")
    if mode == "none":
        return model
    for module in list(model.modules()):
        for child_name, child in list(module.named_children()):
            if not isinstance(child, nn.Linear):
                continue
            if mode == "int8":
                setattr(module, child_name, Int8Linear(child))
            elif child.in_features % INT4_GROUP == 0 and child.out_features % 16 == 0:
                setattr(module, child_name, Int4Linear(child))
    return model
