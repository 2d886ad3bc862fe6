"""Linear layers over a few rows in float32 on a CPU, computed as (W xᵀ)ᵀ.

PyTorch's CPU sgemm (MKL) takes `F.linear(x, W) = x Wᵀ` with a few rows of x (a verify pass over k + 1
tokens, a token tree, a batch of sequences) down a slow path, costing several times one row; the same
product taken as `W xᵀ`, the weight the tall left operand, costs little more than one row, and is no slower
from 2 up to ORIENT_MAX_ROWS rows (`bench/cpu_linear.py` measures both orders on the machine it runs on; the
figures are in docs/performance.md). One row (plain decoding) and longer prefills keep `F.linear`, and so do
weights under ORIENT_MIN_WEIGHT elements (they stay in cache, where `x Wᵀ` is the faster order and the extra
calls of the other cost more than they could save), bf16 and every other device. Both orders sum the same
products and agree to float32 rounding, as passes over different numbers of rows already do in either order.

`orient_linears` swaps the class of a model's float32 CPU `nn.Linear` layers to `OrientedLinear` in place:
the parameters, their sharing (a tied head) and the state dict stay as they are.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

ORIENT_MAX_ROWS = 512  # past this x Wᵀ is as fast again (a long prefill)
ORIENT_MIN_WEIGHT = 1 << 21  # elements (8 MiB in fp32): a 1536 x 1536 projection and larger


def oriented(weight: torch.Tensor, rows: int) -> bool:
    """Whether a product of `rows` rows with `weight` runs as W xᵀ (see the module docstring)."""
    return (2 <= rows <= ORIENT_MAX_ROWS and weight.numel() >= ORIENT_MIN_WEIGHT
            and weight.dtype == torch.float32 and weight.device.type == "cpu")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias), computed as (W xᵀ)ᵀ where that is the faster order."""
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if not oriented(weight, rows):
        return F.linear(x, weight, bias)
    flat = x.reshape(rows, x.shape[-1]).t()
    y = torch.mm(weight, flat) if bias is None else torch.addmm(bias.unsqueeze(1), weight, flat)
    return y.t().contiguous().view(*x.shape[:-1], weight.shape[0])


class OrientedLinear(nn.Linear):
    """nn.Linear whose forward goes through `linear` (same parameters, same state dict)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)


def orient_linears(model: nn.Module) -> nn.Module:
    """Every plain nn.Linear of `model` with float32 weights on a CPU becomes an OrientedLinear, in place;
    returns `model`. The weight's size is judged per product (`oriented`), so that a layer fused from small
    ones (the lean path's q/k/v) is judged by its own size."""
    for module in model.modules():
        weight = module.weight if type(module) is nn.Linear else None
        if weight is not None and weight.dtype == torch.float32 and weight.device.type == "cpu":
            module.__class__ = OrientedLinear
    return model
