"""The lean draft decode path (verispec.backends.lean) against transformers' own forward."""

from __future__ import annotations

import copy

import pytest
import torch
from stats_util import chi2_pvalue
from test_engine import ALPHA, _engine_histograms, _exact_marginals
from tiny import make_engine, perturbed, tiny_qwen2
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from verispec.backends import HFModel, Sequence
from verispec.backends import lean as lean_module
from verispec.backends.lean import LeanBatch, LeanNet, lean_unsupported
from verispec.backends.quant import quantize_model
from verispec.backends.vocab import restrict_head
from verispec.core.sampling import SamplingParams


def lean_model(model) -> LeanBatch:
    """A one-slot lean Model over a transformers model."""
    return LeanBatch(LeanNet(model), slots=1)


def tiny_llama(seed: int) -> LlamaForCausalLM:
    """Llama layout without biases, tied embeddings, 4 query heads over 2 KV heads."""
    config = LlamaConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, initializer_range=0.2)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).float().eval()


MODELS = {"qwen2": lambda: tiny_qwen2(1), "llama": lambda: tiny_llama(2)}


@pytest.mark.parametrize("arch", MODELS)
def test_logits_match_transformers(arch):
    """Prefill, single-token steps, a multi-token chunk after a rollback and last_only: the same logits as
    transformers' forward (fp32)."""
    model = MODELS[arch]()
    hf, lean = Sequence(HFModel(model)), Sequence(lean_model(copy.deepcopy(model)))
    tokens = torch.randint(0, 64, (40,), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(lean.forward(tokens[:12]), hf.forward(tokens[:12]), atol=1e-5, rtol=1e-4)
    for i in range(12, 30):
        torch.testing.assert_close(lean.forward(tokens[i : i + 1]), hf.forward(tokens[i : i + 1]), atol=1e-5, rtol=1e-4)
    lean.rollback(20)
    hf.rollback(20)
    last = lean.forward(tokens[20:27], last_only=True)
    assert last.shape == (1, 64) and lean.length == 27
    torch.testing.assert_close(last, hf.forward(tokens[20:27])[-1:], atol=1e-5, rtol=1e-4)


def test_cache_growth_and_rollback_equal_fresh(monkeypatch):
    """A cache that doubles several times, then rollback-then-decode: equal to one fresh pass."""
    monkeypatch.setattr(lean_module, "FIRST_CAPACITY", 4)
    lean = Sequence(lean_model(tiny_qwen2(3)))
    tokens = torch.randint(0, 64, (50,), generator=torch.Generator().manual_seed(1))
    for i in range(0, 37, 3):  # chunks of 3 across capacities 4, 8, 16, 32, 64
        lean.forward(tokens[i : i + 3])
    lean.rollback(25)
    stepped = torch.cat([lean.forward(tokens[i : i + 1]) for i in range(25, 50)])
    lean.reset()
    fresh = lean.forward(tokens)[25:]
    torch.testing.assert_close(stepped, fresh, atol=1e-5, rtol=1e-4)


def test_context_limit_and_bad_rollback():
    batch = lean_model(tiny_qwen2(4))
    batch.max_length = 10
    lean = Sequence(batch)
    lean.forward(torch.arange(8))
    with pytest.raises(ValueError, match="exceeds the model's context of 10"):
        lean.forward(torch.arange(3))
    with pytest.raises(ValueError, match="cannot roll back to 9"):
        lean.rollback(9)


def test_unsupported_architecture_is_named():
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=2))
    assert "gpt2" in lean_unsupported(gpt2)
    with pytest.raises(ValueError, match="model type 'gpt2'.*use the transformers forward"):
        LeanNet(gpt2)
    assert lean_unsupported(tiny_qwen2(1)) is None and lean_unsupported(tiny_llama(1)) is None


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(1)
    return target, perturbed(target, seed=5, noise=0.3)


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("k", [1, 4])
def test_lean_draft_greedy_identical(pair, k, quant):
    target, draft = pair
    lean = lean_model(copy.deepcopy(draft))
    quantize_model(lean.net, quant)
    plain = make_engine(target).generate([3, 1, 4], max_new_tokens=40)
    spec = make_engine(target, lean, k=k).generate([3, 1, 4], max_new_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0


def test_lean_reduced_head_scores_only_the_subset(pair):
    _, draft = pair
    ids = torch.tensor([0, 5, 9, 63])
    lean = Sequence(lean_model(restrict_head(copy.deepcopy(draft), ids)))
    logits = lean.forward(torch.tensor([3, 1, 4]))
    assert lean.vocab_size == 64 and logits.shape == (3, 64)
    outside = torch.ones(64, dtype=torch.bool)
    outside[ids] = False
    assert torch.isinf(logits[:, outside]).all() and torch.isfinite(logits[:, ids]).all()


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


def test_lean_draft_loop_marginals(small_vocab_pair):
    """Sampling with a lean int4 draft: tokens 1-3 follow the target's exact marginals (N = 3000, V = 8;
    false-failure probability 3e-4)."""
    target, draft = small_vocab_pair
    lean = LeanBatch(LeanNet(copy.deepcopy(draft)), 8)  # one slot per sequence _engine_histograms decodes at once
    quantize_model(lean.net, "int4")
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(target, [3, 1, 2], params, 3)
    counts = _engine_histograms(target, lean, params, n=3000, k=2, steps=3, seed0=30_000)
    for pos in range(3):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos
