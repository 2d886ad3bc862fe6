"""Weight-only int8 quantisation for the draft model (the target is never quantised).

Draft precision changes only how often drafts are accepted, never the output distribution: the verifier
uses the target's full-precision p, and q is whatever distribution the (quantised) draft sampled from.
On CPU the matmul runs in PyTorch's `_weight_int8pack_mm` kernel (int8 weights, per-output-channel scales);
elsewhere the weights are dequantised on the fly.
"""

from __future__ import annotations

import torch
from torch import nn

QUANT_MODES = ("none", "int8")


class Int8Linear(nn.Module):
    """y = x @ (scale[:, None] * w_int8).T + b, symmetric per-output-channel int8 weights."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        w = linear.weight.detach().float()
        scales = w.abs().amax(dim=1).clamp_min(1e-8) / 127.0  # [out]
        self.register_buffer("weight", torch.round(w / scales[:, None]).clamp(-127, 127).to(torch.int8))
        self.register_buffer("scales", scales.to(linear.weight.dtype))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        scales = self.scales.to(x.dtype)
        if x.device.type == "cpu":
            y = torch._weight_int8pack_mm(flat, self.weight, scales)
        else:
            y = flat @ (self.weight.to(x.dtype) * scales[:, None]).T
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def quantize_model(model: nn.Module, mode: str) -> nn.Module:
    """Replace every nn.Linear (attention, MLP, LM head) with its quantised version, in place."""
    if mode not in QUANT_MODES:
        raise ValueError(f"unknown quantisation '{mode}' (use {', '.join(QUANT_MODES)})")
    if mode == "none":
        return model
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model
