"""Presence/frequency penalties, min_tokens, stop token ids, ignore_eos and logprobs stay exact under
speculation: greedy speculative output equals plain decoding token for token, and sampled tokens follow
the target's exact per-position marginals (the penalties make each position depend on the ones before)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from stats_util import chi2_pvalue, generation_histograms
from test_engine import _exact_marginals
from tiny import make_engine, perturbed, tiny_qwen2

from verispec import SamplingParams
from verispec.core.sampling import count_rows, probs_from_logits, process_logits, token_counts

ALPHA = 1e-4
PROMPT = [3, 1, 2]


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(1)
    return target, perturbed(target, seed=2, noise=0.05)


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


def test_count_rows_match_a_loop():
    counts = torch.tensor([0, 2, 0, 1], dtype=torch.int32)
    tokens = torch.tensor([2, 2, 1])
    rows = count_rows(counts, tokens)
    expected = [counts.clone()]
    for t in tokens.tolist():
        nxt = expected[-1].clone()
        nxt[t] += 1
        expected.append(nxt)
    assert torch.equal(rows, torch.stack(expected))
    assert torch.equal(token_counts(torch.tensor([3, 3, 0]), 4), torch.tensor([1, 0, 0, 2], dtype=torch.int32))


def test_penalties_follow_openai_formula():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    counts = torch.tensor([0, 1, 3, 0])
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = process_logits(logits, params, counts=counts)
    assert torch.allclose(out, torch.tensor([[1.0, 2.0 - 0.5 - 0.25, 3.0 - 0.5 - 0.75, 4.0]]))


def test_min_tokens_masks_stop_ids_only_below_min_tokens():
    logits = torch.zeros(3, 5)
    params = SamplingParams(min_tokens=4, stop_ids=(1, 3))
    out = process_logits(logits, params, position=2)  # rows at positions 2, 3, 4
    assert torch.isinf(out[:2, [1, 3]]).all() and (out[2] == 0).all() and (out[:, [0, 2, 4]] == 0).all()


@pytest.mark.parametrize("params,k", [
    (SamplingParams(presence_penalty=1.5), 4),
    (SamplingParams(frequency_penalty=0.7), 2),
    (SamplingParams(presence_penalty=-0.5, frequency_penalty=0.9, repetition_penalty=1.3), 1),
], ids=["presence", "frequency", "all_three"])
def test_penalised_greedy_identical_to_plain(pair, params, k):
    target, draft = pair
    plain = make_engine(target).generate(PROMPT, params, max_new_tokens=32)
    spec = make_engine(target, draft, k=k).generate(PROMPT, params, max_new_tokens=32)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.drafted > 0
    unpenalised = make_engine(target).generate(PROMPT, max_new_tokens=32)
    assert plain.token_ids != unpenalised.token_ids  # the penalty really acted


@pytest.mark.parametrize("k", [3])
def test_min_tokens_stop_ids_and_ignore_eos_greedy_identical(pair, k):
    target, draft = pair
    free = make_engine(target).generate(PROMPT, max_new_tokens=30).token_ids
    eos = free[5]  # an EOS the model emits early
    first = free.index(eos)
    for kwargs in ({}, {"ignore_eos": True}):
        plain = make_engine(target, eos=[eos]).generate(PROMPT, max_new_tokens=30, **kwargs)
        spec = make_engine(target, draft, k=k, eos=[eos]).generate(PROMPT, max_new_tokens=30, **kwargs)
        assert spec.token_ids == plain.token_ids
    assert spec.token_ids == free and spec.finish_reason == "length"  # ignore_eos: EOS did not stop it
    params = SamplingParams(min_tokens=first + 8)
    plain = make_engine(target, eos=[eos]).generate(PROMPT, params, max_new_tokens=30)
    spec = make_engine(target, draft, k=k, eos=[eos]).generate(PROMPT, params, max_new_tokens=30)
    assert spec.token_ids == plain.token_ids and eos not in spec.token_ids[: first + 8]
    stop_id = free[2]
    spec = make_engine(target, draft, k=k).generate(PROMPT, max_new_tokens=30, stop_token_ids=[stop_id])
    assert spec.token_ids == free[: free.index(stop_id) + 1] and spec.finish_reason == "stop"


def test_logprobs_are_the_target_processed_distribution(pair):
    """Each reported logprob is log p of the chosen token under plain decoding's processed distribution,
    whether the token was a draft accepted, recovered or bonus."""
    target, draft = pair
    params = SamplingParams(temperature=0.9, top_k=20, frequency_penalty=0.5, seed=3)
    out = make_engine(target, draft, k=3).generate(PROMPT, params, max_new_tokens=12, logprobs=2)
    assert len(out.logprobs) == len(out.token_ids) == 12
    ids = list(PROMPT)
    for token, (logprob, top) in zip(out.token_ids, out.logprobs):
        with torch.no_grad():
            logits = target(input_ids=torch.tensor([ids])).logits[:, -1]
        counts = token_counts(torch.tensor(ids[len(PROMPT):], dtype=torch.long), logits.shape[-1])
        p = probs_from_logits(logits, params, counts=counts)[0]
        assert math.isclose(logprob, math.log(p[token]), abs_tol=1e-4)
        assert [t for t, _ in top] == torch.topk(p, 2).indices.tolist()
        ids.append(token)


def _loop_histograms(target, draft, params: SamplingParams, steps: int, n: int) -> torch.Tensor:
    eng = make_engine(target, draft, k=2, slots=8)
    return generation_histograms(eng, PROMPT, params, n, steps, target.config.vocab_size)[0]


PENALISED = SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.8, min_tokens=2,
                           stop_ids=(0, 5))
# penalties strong enough that a row missing the drafts before it shows at N = 1000 (the first drafts follow a
# committed token, which already carries penalties of its own)
STRONG = replace(PENALISED, presence_penalty=3.0, frequency_penalty=3.0)


def test_verify_rows_equal_plain_processing_position_by_position(small_vocab_pair):
    """Exact, before the statistics: the target's k+1 verify rows and the draft's q for k drafts equal
    what plain decoding computes at each of those positions (its own counts, its own position)."""
    from verispec.backends import HFModel
    from verispec.core.rows import target_rows
    from verispec.core.sampling import make_rng
    from verispec.core.sequence import TokenSequence
    from verispec.proposers import DraftModel

    target, draft = small_vocab_pair
    generated = [4, 4, 6]
    seq = TokenSequence(PROMPT + generated, 20, torch.device("cpu"))
    seq.prompt_length = len(PROMPT)
    drafter = DraftModel(HFModel(draft), 8)
    drafter.start(0, seq, PENALISED, make_rng(0, "cpu"))
    drafts = drafter.propose([(0, seq, 3, None)])[0]
    tokens = drafts.tokens
    with torch.no_grad():
        t_logits = target(input_ids=torch.tensor([seq.ids + tokens.tolist()])).logits[0, len(seq) - 1 :]  # [4, V]
        d_logits = draft(input_ids=torch.tensor([seq.ids + tokens.tolist()])).logits[0, len(seq) - 1 :]
    rows = target_rows(t_logits, tokens, PENALISED, seq)  # [4, V]
    for i in range(4):
        ids = torch.tensor(generated + tokens[:i].tolist())
        plain = probs_from_logits(t_logits[i : i + 1], PENALISED, counts=token_counts(ids, 8), position=3 + i)
        assert torch.allclose(rows[i : i + 1], plain, atol=1e-6), i
        if i < 3:
            q = probs_from_logits(d_logits[i : i + 1], PENALISED, counts=token_counts(ids, 8), position=3 + i)
            assert torch.allclose(drafts.probs[i : i + 1], q, atol=1e-5), i


@pytest.mark.parametrize("params,n", [(PENALISED, 2000), (STRONG, 1000)], ids=["penalised", "strong"])
def test_penalised_loop_marginals_match_target(small_vocab_pair, params, n):
    """Tokens 1-4 of speculative generations (token 1 from the prefill; then k = 2: drafts at positions 2-3 are
    verified by rows that must count the drafts before them, and min_tokens masks the stop ids at positions 1-2
    only) follow the target's exact marginals. V = 8, N = 2000 generations: detects TV >= ~0.06 (N = 1000 under
    the negative control's strong penalties); false-failure probability 4 positions x ALPHA = 4e-4 each."""
    target, draft = small_vocab_pair
    exact = _exact_marginals(target, PROMPT, params, 4)
    counts = _loop_histograms(target, draft, params, 4, n)
    for pos in range(4):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_penalised_loop_negative_control(small_vocab_pair, monkeypatch):
    """The same test (strong penalties) fails when every verify row gets the committed counts only (the drafts
    before a row not counted): exactness needs the per-row counts."""

    monkeypatch.setattr("verispec.core.rows.count_rows", lambda c, tokens, paths=None: c.unsqueeze(0).repeat(tokens.numel() + 1, 1))
    target, draft = small_vocab_pair
    exact = _exact_marginals(target, PROMPT, STRONG, 4)  # token 1 from the prefill, tokens 2-3 drafted
    counts = _loop_histograms(target, draft, STRONG, 4, 1000)  # p ~1e-15 at this N (position 3)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(4)) < ALPHA
