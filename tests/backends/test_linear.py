"""Oriented linear layers (verispec.backends.linear): the same function as F.linear, only the order of the product."""

import pytest
import torch
from tiny import save_tiny_pair
from torch import nn
from torch.nn import functional as F

import verispec.backends.linear
from verispec.assembly.build import build
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.backends import HFModel
from verispec.backends.lean import LeanBatch
from verispec.backends.linear import (
    ORIENT_MAX_ROWS,
    ORIENT_MIN_WEIGHT,
    OrientedLinear,
    linear,
    orient_linears,
    oriented,
)
from verispec.backends.quant import Int4Linear


@pytest.fixture
def any_weight(monkeypatch):
    """Orient weights of every size (the tiny test models' are far under ORIENT_MIN_WEIGHT)."""
    monkeypatch.setattr(verispec.backends.linear, "ORIENT_MIN_WEIGHT", 0)


@pytest.mark.parametrize("shape", [(2, 48), (5, 48), (3, 4, 48), (1, 7, 48), (ORIENT_MAX_ROWS, 48)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear_is_f_linear(shape, bias, any_weight):
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=bias)
    x = torch.randn(*shape)
    y = linear(x, layer.weight, layer.bias)
    assert y.shape == (*shape[:-1], 80) and y.is_contiguous()
    assert torch.allclose(y, F.linear(x, layer.weight, layer.bias), atol=1e-5, rtol=1e-5)


def test_which_products_are_oriented():
    w = torch.zeros(ORIENT_MIN_WEIGHT // 1024, 1024)
    assert [oriented(w, rows) for rows in (0, 1, 2, ORIENT_MAX_ROWS, ORIENT_MAX_ROWS + 1)] == [
        False, False, True, True, False]
    assert not oriented(w.bfloat16(), 5) and not oriented(w.half(), 5)
    assert not oriented(w[:-1], 5)  # under ORIENT_MIN_WEIGHT elements
    x = torch.randn(1, 1, 4)  # one row (plain decoding): F.linear itself, bitwise
    w = torch.randn(8, 4)
    assert torch.equal(linear(x, w), F.linear(x, w))


def test_orient_linears_keeps_parameters_and_their_sharing(any_weight):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 6), nn.Linear(6, 6), nn.Linear(6, 10, bias=False))
    model[2].weight = model[0].weight  # a tied head
    half = nn.Linear(6, 6).bfloat16()
    model.append(half)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    assert orient_linears(model) is model
    assert type(model[1]) is OrientedLinear and type(model[2]) is OrientedLinear
    assert type(half) is nn.Linear  # bf16: F.linear
    assert model[2].weight is model[0].weight
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    x = torch.randn(3, 6)
    assert torch.allclose(model[1](x), F.linear(x, model[1].weight, model[1].bias), atol=1e-6)


@pytest.fixture(scope="module")
def pair_dirs(tmp_path_factory):
    return save_tiny_pair(tmp_path_factory.mktemp("linear"))


def _linears(module: nn.Module) -> list[type]:
    return [type(m) for m in module.modules() if isinstance(m, nn.Linear)]


def test_models_verispec_loads_are_oriented_in_fp32_only(pair_dirs, any_weight):
    target, draft = pair_dirs
    pipe = build(TargetSpec(target, backend="hf", device="cpu", dtype="fp32"),
                 DraftSpec("model", draft, quant="none", forward="lean"), 4)
    assert isinstance(pipe.engine.target, HFModel) and isinstance(pipe.draft_model, LeanBatch)
    for module in (pipe.engine.target.model, pipe.draft_model.net):  # the lean net's fused layers too
        kinds = _linears(module)
        assert kinds and set(kinds) == {OrientedLinear}
    quantized = build(TargetSpec(target, backend="hf", device="cpu", dtype="fp32"),
                      DraftSpec("model", draft, quant="int4", forward="lean"), 4)
    assert set(_linears(quantized.engine.target.model)) == {OrientedLinear}
    assert any(isinstance(m, Int4Linear) for m in quantized.draft_model.net.modules())
    bf16 = build(TargetSpec(target, backend="hf", device="cpu", dtype="bf16"), None, 0)  # bf16: F.linear
    assert set(_linears(bf16.engine.target.model)) == {nn.Linear}


def test_a_model_the_caller_loaded_is_left_as_it_is(pair_dirs, any_weight):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target, _ = pair_dirs
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    pipe = build(TargetSpec(model, tokenizer=AutoTokenizer.from_pretrained(target), device="cpu"), None, 0)
    assert pipe.engine.target.model is model and set(_linears(model)) == {nn.Linear}


def test_small_weights_keep_f_linear(pair_dirs):
    target, _ = pair_dirs
    pipe = build(TargetSpec(target, backend="hf", device="cpu", dtype="fp32"), None, 0)
    layer = pipe.engine.target.model.lm_head  # the tiny model's weights are small
    assert type(layer) is OrientedLinear and layer.weight.numel() < ORIENT_MIN_WEIGHT
    x = torch.randn(5, layer.in_features)
    assert torch.equal(layer(x), F.linear(x, layer.weight, layer.bias))  # F.linear itself, bitwise


@pytest.mark.parametrize("drafter, k", [("model", 4), ("tree", "auto")])
def test_greedy_speculation_through_oriented_layers_is_plain_decoding(pair_dirs, any_weight, drafter, k):
    target, draft = pair_dirs
    spec = build(TargetSpec(target, backend="hf", device="cpu", dtype="fp32"),
                 DraftSpec(drafter, draft, quant="none", forward="lean"), k)
    plain = build(TargetSpec(target, backend="hf", device="cpu", dtype="fp32"), None, 0)
    target_model = spec.engine.target
    assert OrientedLinear in set(_linears(getattr(target_model, "net", None) or target_model.model))
    accepted = 0
    for prompt in ("ab", "hello there", "x" * 40):
        out = spec.generate(prompt, max_new_tokens=24)
        assert out.token_ids == plain.generate(prompt, max_new_tokens=24).token_ids
        accepted += out.stats.accepted
    assert accepted > 0  # verify passes over several rows ran


def test_a_fused_layer_is_judged_by_its_own_size(pair_dirs, monkeypatch):
    """The lean path fuses q/k/v: small projections can make a fused weight over the bound."""
    target, draft = pair_dirs
    pipe = build(TargetSpec(target, backend="hf", device="cpu", dtype="fp32"),
                 DraftSpec("model", draft, quant="none", forward="lean"), 4)
    layer = pipe.draft_model.net.layers[0]
    monkeypatch.setattr(verispec.backends.linear, "ORIENT_MIN_WEIGHT", layer.qkv.weight.numel())  # q alone is under it
    assert type(layer.qkv) is OrientedLinear and oriented(layer.qkv.weight, 5)
    assert not oriented(layer.o.weight, 5)
