"""llama.cpp's infill sampler (verispec.core.infill): its steps on hand-made rows, and speculative sampling under it
exact: the loop's marginals against enumeration of the transformed target, with a negative control."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from stats_util import chi2_pvalue
from test_engine import ALPHA, _engine_histograms, _exact_marginals
from tiny import perturbed, tiny_qwen2

from verispec.core import rows as rows_module
from verispec.core.infill import TokenPieces, infill_row, infill_rows
from verispec.core.sampling import SamplingParams, probs_from_logits

PIECES = [b"ret", b"return", b"x", b"re", b"", b"y", b"xs", b"z"]  # id 4: a special token (end of text)
VOCAB = TokenPieces(lambda: PIECES, frozenset({4}), 4)


def pairs(probs: dict[int, float]) -> list[tuple[int, float]]:
    ids = sorted(probs, key=lambda t: (-probs[t], t))
    return infill_row([probs[t] for t in ids], ids, VOCAB)


def test_enough_end_of_text_ends_the_completion():
    # 3 * 0.3 * 3 = 2.7 > 0.7: only the end-of-text tokens remain
    assert pairs({0: 0.5, 4: 0.3, 2: 0.2}) == [(4, 1.0)]


def test_a_prefix_merges_into_the_likelier_token_then_the_thresholds():
    # "ret" is a prefix of "return": the likelier ("ret") takes both; "x" (0.15 < 0.2) goes; the end-of-text stays
    got = dict(pairs({0: 0.5, 1: 0.3, 2: 0.15, 4: 0.01, 5: 0.04}))
    assert got.keys() == {0, 4} and got[0] == pytest.approx(0.8 / 0.81) and got[4] == pytest.approx(0.01 / 0.81)
    # the other way round: "return" is likelier, so it takes "re" and "ret"
    got = dict(pairs({1: 0.6, 0: 0.25, 3: 0.14, 7: 0.01}))
    assert got == {1: pytest.approx(1.0)}


def test_no_likely_text_token_left_gives_the_end_token():
    assert pairs({2: 0.19, 5: 0.19, 7: 0.19, 3: 0.19, 4: 0.001}) == [(4, 1.0)]  # no prefixes, none reaches 0.2
    # "x" is a prefix of "xs": merged (0.37), a text token survives
    assert dict(pairs({2: 0.19, 5: 0.19, 7: 0.19, 6: 0.18, 4: 0.001})).keys() == {2, 4}


def test_without_an_end_token_among_the_candidates_the_likeliest_text_token_stays():
    """min_tokens masks the end tokens: the rule that would end the completion takes the likeliest text instead."""
    assert pairs({2: 0.19, 5: 0.18, 7: 0.17, 3: 0.16}) == [(2, 1.0)]


def test_ties_past_the_candidate_limit_do_not_fail_a_round():
    """top_k keeps every token tied with the k-th: a row can hold more than MAX_CANDIDATES; the best are taken."""
    probs = torch.full((2, 600), 1 / 600)
    out = infill_rows(probs, TokenPieces(lambda: [b"%03d" % i for i in range(600)], frozenset(), 0))
    assert torch.allclose(out.sum(-1), torch.ones(2)) and (out > 0).sum(-1).tolist() == [1, 1]


def test_the_second_threshold_is_one_over_the_text_tokens_plus_one():
    got = dict(pairs({2: 0.5, 5: 0.28, 7: 0.22}))  # all >= 0.2; then 1 / (3 + 1) = 0.25 drops 0.22
    assert got == {2: pytest.approx(0.5 / 0.78), 5: pytest.approx(0.28 / 0.78)}


def test_rows_are_distributions_on_their_candidates():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.0, 0.01, 0.04, 0.0, 0.0], [0.0, 0.0, 0.5, 0.0, 0.0, 0.28, 0.0, 0.22]])
    out = infill_rows(probs, VOCAB)
    assert out.shape == probs.shape and torch.allclose(out.sum(-1), torch.ones(2))
    assert out[0].nonzero().squeeze(-1).tolist() == [0, 4] and out[1].nonzero().squeeze(-1).tolist() == [2, 5]


def test_params_need_top_k_and_the_vocabulary():
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(temperature=1.0, infill_sampler=True)
    params = SamplingParams(temperature=1.0, top_k=4, infill_sampler=True)
    with pytest.raises(ValueError, match="token pieces"):
        probs_from_logits(torch.zeros(1, 8), params)
    assert not SamplingParams(top_k=4, infill_sampler=True).infilling  # greedy: the argmax, untransformed


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


PARAMS = SamplingParams(temperature=1.0, top_k=6, infill_sampler=True).with_vocabulary(VOCAB)


def _histograms(pair):
    import tiny

    make = tiny.make_engine

    def with_vocabulary(*args, **kwargs):
        engine = make(*args, **kwargs)
        engine.vocabulary = VOCAB
        return engine

    patch = pytest.MonkeyPatch()
    patch.setattr(tiny, "make_engine", with_vocabulary)
    patch.setattr(__import__("test_engine"), "make_engine", with_vocabulary)
    try:
        return _engine_histograms(*pair, PARAMS, n=2000, k=2, steps=4, seed0=0)
    finally:
        patch.undo()


def test_loop_marginals_under_the_infill_sampler_match_the_target(small_vocab_pair):
    """Tokens 1-4 of speculative generations (k = 2, the draft's q transformed too) follow the exact marginals of
    the transformed target (N = 2000, V = 8; false-failure probability 4 x ALPHA = 4e-4)."""
    target, _ = small_vocab_pair
    exact = _exact_marginals(target, [3, 1, 2], PARAMS, 4)
    assert any(float(e[4]) > 0.05 for e in exact) and all(float(e[3]) == 0 for e in exact)  # the transform bites
    counts = _histograms(small_vocab_pair)
    for pos in range(4):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_negative_control_verifying_against_the_untransformed_target_fails(small_vocab_pair, monkeypatch):
    """The control: the target's rows without the transform (the draft's q still transformed) must be caught
    (it is by a wide margin: with N = 2000 its smallest p-value is far below ALPHA)."""
    target_rows = rows_module.target_rows
    monkeypatch.setattr(rows_module, "target_rows", lambda logits, drafts, params, seq: target_rows(
        logits, drafts, replace(params, infill_sampler=False), seq))
    target, _ = small_vocab_pair
    exact = _exact_marginals(target, [3, 1, 2], PARAMS, 4)
    counts = _histograms(small_vocab_pair)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(4)) < ALPHA
