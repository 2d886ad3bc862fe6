"""Negative controls through the real code: each test breaks one function of the library in a subtle way
(monkeypatched for the test only) and asserts that the suite's own statistic rejects the result. A
mutation that the statistics let through would be a missing test.

| mutation | caught by |
|---|---|
| recovered token drawn from p instead of norm(max(0, p - q)) | verifier per-position fit (test_verify) |
| bonus token drawn from row k-1 instead of row k | verifier per-position fit, bonus position |
| q(x) read from the wrong draft position | verifier per-position fit |
| acceptance as u <= p/q (a draw u = 0 accepts a token with p = 0) | the u = 0 test (test_verify) |
| repetition-penalty presence of a verify row shifted by one draft | loop marginals (test_exactness) |
| draft samples from its top-p nucleus but reports q without top-p | loop marginals with top-p |
"""

from __future__ import annotations

import dataclasses

import pytest
import test_exactness as exactness
import test_verify
import torch
from tiny import as_model

import verispec.proposers.draft_model as draft_module
from verispec.core import sampling, verify
from verispec.core.sampling import SamplingParams
from verispec.proposers import DraftModel

ALPHA = test_verify.ALPHA
VERIFIER_PARAMS = SamplingParams(temperature=0.9)


def _verifier_rejects() -> bool:
    """The verifier's per-position statistic (chi-square p < ALPHA at some position)."""
    fits = test_verify.per_position_fit(VERIFIER_PARAMS, seed=0)
    return min(p_value for p_value, _, _ in fits) < ALPHA


def test_the_unmutated_verifier_passes():
    assert not _verifier_rejects()


def test_residual_replaced_by_p(monkeypatch):
    monkeypatch.setattr(verify, "recovery_distribution", lambda p_row, q_row: p_row)
    assert _verifier_rejects()


def test_bonus_drawn_from_row_k_minus_1(monkeypatch):
    real = verify.next_token_distribution

    def mutant(target_probs, draft_tokens, draft_probs, num_accepted):
        out = real(target_probs, draft_tokens, draft_probs, num_accepted)
        k = draft_tokens.shape[1]
        bonus = num_accepted == k
        return torch.where(bonus[:, None], target_probs[:, max(k - 1, 0)], out)

    monkeypatch.setattr(verify, "next_token_distribution", mutant)
    assert _verifier_rejects()


def test_q_from_the_wrong_position(monkeypatch):
    real = verify.draft_probs_at
    monkeypatch.setattr(verify, "draft_probs_at", lambda q, tokens: real(q if q is None else q.roll(1, dims=1), tokens))
    assert _verifier_rejects()


def test_accept_when_u_equals_the_ratio(monkeypatch):
    """u <= p/q with an unclamped ratio: expressed through the real `u < acceptance_probability` comparison by
    returning the next float above p/q."""
    monkeypatch.setattr(verify, "acceptance_probability",
                        lambda p_x, q_x: torch.nextafter(p_x / q_x, torch.tensor(float("inf"))))
    with pytest.raises(AssertionError):
        test_verify.test_a_zero_probability_draft_is_never_accepted_even_at_u_zero(monkeypatch)


def _loop_rejects(engine, params, exact) -> bool:
    try:
        exactness.assert_marginals(exactness.histograms(engine, params, seed0=90_000), exact)
    except AssertionError:
        return True
    return False


def test_presence_shifted_by_one_draft(monkeypatch, pair):
    """Row i of a verify pass penalises the context plus drafts[:i + 1] (its own token too)."""
    real = sampling.presence_rows

    def mutant(presence, tokens, paths=None):
        rows = real(presence, tokens, paths)
        return torch.cat([rows[1:], rows[-1:]])

    monkeypatch.setattr("verispec.core.rows.presence_rows", mutant)
    target, draft = pair
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8)
    exact = exactness.exact_marginals(exactness.hf_logits(target), exactness.PROMPT, params, exactness.STEPS, 8)
    assert _loop_rejects(exactness.make_engine(target, draft, k=2, slots=exactness.SLOTS), params, exact)


def test_top_p_on_the_draft_sample_but_not_on_its_q(monkeypatch, pair):
    """The draft draws its token from its top-p nucleus but hands the verifier q without top-p. (A draft
    that neither samples nor reports with top-p is exact, as any q is: that is not a defect.)"""
    real_rows, real_sample = draft_module.processed_rows, draft_module.sample
    top_p = 0.6

    def unfiltered(logits, params, *rest, **kwargs):
        return real_rows(logits, dataclasses.replace(params, top_p=1.0), *rest, **kwargs)

    def sample_from_nucleus(q, rng):
        nucleus = sampling._filter_top_p(q.log(), top_p).softmax(dim=-1)
        return real_sample(nucleus, rng)

    monkeypatch.setattr(draft_module, "processed_rows", unfiltered)
    monkeypatch.setattr(draft_module, "sample", sample_from_nucleus)
    target, draft = pair
    params = SamplingParams(temperature=1.0, top_p=top_p)
    exact = exactness.exact_marginals(exactness.hf_logits(target), exactness.PROMPT, params, exactness.STEPS, 8)
    engine = exactness._engine(as_model(target, exactness.SLOTS), DraftModel(as_model(draft, exactness.SLOTS), 8))
    assert _loop_rejects(engine, params, exact)


@pytest.fixture(scope="module")
def pair():
    target = exactness.tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, exactness.perturbed(target, seed=12, noise=0.5)
