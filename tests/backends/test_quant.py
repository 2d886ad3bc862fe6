"""The quantised linear layers against the dequantised weights they stand for."""

import pytest
import torch
from torch import nn

from verispec.backends.quant import INT4_GROUP, PACKED_MAX_ROWS, Int4Linear, Int8Linear, quantize_model


def _dequantized_int4(layer: Int4Linear, linear: nn.Linear) -> torch.Tensor:
    """The weights the int4 layer should compute with, rebuilt from the float weights by the documented rule."""
    w = linear.weight.detach().float()
    g = w.reshape(w.shape[0], -1, INT4_GROUP)
    low = g.amin(-1, keepdim=True)
    scale = ((g.amax(-1, keepdim=True) - low) / 15).clamp_min(1e-8)
    return (torch.round((g - low) / scale).clamp(0, 15) * scale + low).reshape_as(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_linear_matches_its_dequantized_weights(dtype):
    torch.manual_seed(0)
    linear = nn.Linear(128, 96, bias=True).to(dtype)
    layer = Int4Linear(linear)
    x = torch.randn(2, 2, 128, dtype=dtype)  # 4 rows: the packed kernel
    ref = x.float() @ _dequantized_int4(layer, linear).T + linear.bias.float()
    y = layer(x)
    assert y.shape == (2, 2, 96) and y.dtype == dtype
    tol = 0.05  # the packed CPU kernels compute in bf16 whatever the layer's dtype
    assert torch.allclose(y.float(), ref, atol=tol * ref.abs().max().item(), rtol=0)
    # 4 bits are coarse: the layer is close to the original, not equal to it
    err = (y.float() - linear(x).float()).abs().max() / linear(x).float().abs().max()
    assert 1e-4 < err < 0.2


def test_int4_scales_are_kept_in_the_kernels_dtype():
    """A float32 layer keeps its scales and zeros in bf16, the dtype the packed CPU kernel computes in, so that
    no call converts them (for a 151936 x 896 LM head that is 8.5M values a step); its outputs are the ones of
    scales rounded to float32 first and converted per call."""
    torch.manual_seed(3)
    linear = nn.Linear(256, 160, bias=False)
    layer = Int4Linear(linear)
    assert layer.scales_zeros.dtype == torch.bfloat16
    x = torch.randn(3, 256)
    w = linear.weight.detach().reshape(160, -1, INT4_GROUP)
    low = w.amin(-1)
    scale = ((w.amax(-1) - low) / 15).clamp_min(1e-8)
    per_call = torch.stack([scale.T, (low + 8 * scale).T], dim=-1).contiguous().to(torch.bfloat16)
    ref = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), layer.weight, INT4_GROUP, per_call)
    assert torch.equal(layer(x), ref.float())


@pytest.mark.parametrize("cls", [Int4Linear, Int8Linear])
def test_large_batches_use_the_float_weights(cls):
    """Prefill-sized batches run on the kept bf16 weights (the packed kernels are matrix-vector kernels)."""
    torch.manual_seed(2)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    layer = cls(linear)
    x = torch.randn(PACKED_MAX_ROWS + 1, 64, dtype=torch.bfloat16)
    assert torch.equal(layer(x), linear(x))
    assert not torch.equal(layer(x[:PACKED_MAX_ROWS]), linear(x[:PACKED_MAX_ROWS]))


def test_int8_linear_close_to_float():
    torch.manual_seed(1)
    linear = nn.Linear(64, 32)
    x = torch.randn(PACKED_MAX_ROWS, 64)
    y, ref = Int8Linear(linear)(x), linear(x)
    assert (y - ref).abs().max() < 0.02 * ref.abs().max()


def test_quantize_model_replaces_linears_and_rejects_unknown_modes():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 8), nn.Linear(8, 16))
    quantize_model(model, "int4")
    # the packed kernel takes in % 32 == 0 and out % 16 == 0 only
    assert [type(m).__name__ for m in model] == ["Int4Linear", "ReLU", "Int4Linear", "Linear", "Linear"]
    with pytest.raises(ValueError, match="unknown quantisation 'int3'"):
        quantize_model(model, "int3")
