"""The reduced-vocabulary draft head: which tokens it keeps, what it computes, and that speculation with it
stays exact (greedy identity here; sampled marginals in test_exactness)."""

import pytest
import torch
from tiny import byte_tokenizer, make_engine, perturbed, tiny_qwen2

from verispec.backends import HFModel, Sequence
from verispec.backends.quant import quantize_model
from verispec.backends.vocab import ROW_MULTIPLE, SubsetHead, frequent_tokens, restrict_head


def test_frequent_tokens_keeps_specials_and_lowest_ids():
    tok = byte_tokenizer()  # 256 byte tokens, then 3 specials (256, 257, 258)
    ids = frequent_tokens(tok, 100, 264).tolist()
    assert len(ids) == 2 * ROW_MULTIPLE and ids == sorted(ids)
    specials = set(tok.all_special_ids)
    assert specials <= set(ids)
    assert [i for i in ids if i not in specials] == list(range(2 * ROW_MULTIPLE - len(specials)))
    assert frequent_tokens(tok, 10_000, 264).tolist() == list(range(264))  # capped at the vocabulary
    with pytest.raises(ValueError, match="must be a positive number"):
        frequent_tokens(tok, 0, 264)


def test_subset_head_scores_only_its_tokens():
    model = tiny_qwen2(3, vocab_size=96)
    prompt = torch.tensor([5, 9, 2, 7])
    full = Sequence(HFModel(model)).forward(prompt)  # [4, 96]
    ids = torch.tensor([0, 3, 5, 40, 95])
    restrict_head(model, ids)
    assert isinstance(model.get_output_embeddings(), SubsetHead)
    reduced = HFModel(model)
    assert reduced.vocab_size == 96
    out = Sequence(reduced).forward(prompt)
    keep = torch.zeros(96, dtype=torch.bool)
    keep[ids] = True
    assert torch.allclose(out[:, keep], full[:, keep], atol=1e-5)
    assert torch.isneginf(out[:, ~keep]).all()


@pytest.mark.parametrize("quant", ["none", "int4"])
@pytest.mark.parametrize("k", [1, 4])
def test_reduced_vocab_draft_greedy_identical(k, quant):
    """Half the vocabulary (the target often picks tokens the draft cannot propose): output unchanged."""
    target = tiny_qwen2(1)
    draft = quantize_model(restrict_head(perturbed(target, seed=2, noise=0.05), torch.arange(0, 64, 2)), quant)
    plain = make_engine(target).generate([3, 1, 4], max_new_tokens=40)
    spec = make_engine(target, draft, k=k).generate([3, 1, 4], max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    assert 0 < spec.stats.accepted < spec.stats.drafted
    assert any(t % 2 for t in plain.token_ids)  # some output tokens lie outside the draft's subset
