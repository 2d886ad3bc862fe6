"""n-gram (prompt lookup) and hybrid drafters: lookup edge cases, greedy identity, distribution, EOS, limits."""

from __future__ import annotations

import pytest
import torch
from stats_util import chi2_pvalue
from test_engine import _exact_marginals
from tiny import make_engine, perturbed, tiny_qwen2

from verispec import SamplingParams
from verispec.proposers.ngram import find_continuation

ALPHA = 1e-4


def test_find_continuation_edges():
    assert find_continuation([1, 2, 3], 4, 3, 1) == ([], 0)  # no earlier occurrence
    assert find_continuation([5], 4, 3, 1) == ([], 0)  # too short
    # longest suffix first, most recent occurrence, continuation capped at k
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert find_continuation(toks, 2, 3, 1) == ([7, 8], 3)
    assert find_continuation(toks, 10, 3, 1) == ([7, 8, 0, 1, 2, 3], 3)
    # a match whose continuation runs to the end of the sequence is cut there
    assert find_continuation([4, 5, 4, 5], 5, 2, 1) == ([4, 5], 2)
    assert find_continuation([4, 5, 6, 4], 3, 3, 2) == ([], 0)  # min_ngram respected
    with pytest.raises(ValueError):
        from verispec.proposers import NgramProposer

        NgramProposer(max_ngram=1, min_ngram=2)


@pytest.fixture(scope="module")
def models():
    target = tiny_qwen2(1)
    return target, perturbed(target, seed=2, noise=0.05)


REPETITIVE = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("prompt", [REPETITIVE, [1, 2, 3], list(range(2, 50))])
def test_greedy_identical_to_plain(models, drafter, k, prompt):
    target, draft = models
    plain = make_engine(target).generate(prompt, max_new_tokens=40)
    spec = make_engine(target, draft, k=k, drafter=drafter).generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    if prompt is REPETITIVE or drafter == "hybrid":
        assert spec.stats.drafted > 0


def test_ngram_draft_cut_at_eos_and_max_tokens(models):
    target, _ = models
    plain = make_engine(target).generate(REPETITIVE, max_new_tokens=30).token_ids
    for eos_pos in (1, 6):
        eos = plain[eos_pos]
        spec = make_engine(target, k=8, eos=[eos], drafter="ngram").generate(REPETITIVE, max_new_tokens=30)
        assert spec.token_ids == plain[: plain.index(eos) + 1] and spec.finish_reason == "stop"
    for max_new in (1, 2, 5):
        spec = make_engine(target, k=8, drafter="ngram").generate(REPETITIVE, max_new_tokens=max_new)
        assert spec.token_ids == plain[:max_new]


def test_no_match_is_plain_decoding(models):
    target, _ = models
    spec = make_engine(target, k=4, drafter="ngram").generate([1], max_new_tokens=1)
    assert spec.stats.drafted == 0 and spec.stats.target_forwards == 1


@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)


def _histograms(target, params, drafter, n, steps):
    counts = torch.zeros(steps, target.config.vocab_size, dtype=torch.long)
    eng = make_engine(target, k=2, drafter=drafter)
    drafted = 0
    for i in range(n):
        out = eng.generate([3, 1, 2, 3, 1], SamplingParams(**{**params.__dict__, "seed": i}), max_new_tokens=steps)
        drafted += out.stats.drafted
        for pos, tok in enumerate(out.token_ids):
            counts[pos, tok] += 1
    return counts, drafted


def test_ngram_sampling_marginals_match_target(small_vocab_target):
    """Deterministic drafts under sampling: tokens 1-3 follow the target's exact marginals.
    N = 3000, V = 8; false-failure probability 3 x ALPHA = 3e-4."""
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(small_vocab_target, [3, 1, 2, 3, 1], params, 3)
    counts, drafted = _histograms(small_vocab_target, params, "ngram", 3000, 3)
    assert drafted > 1000  # the prompt's repeats really produced drafts
    for pos in range(3):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_ngram_negative_control_fails(small_vocab_target, monkeypatch):
    """An always-accept verifier with n-gram drafts emits the copied tokens, not p: the test must fail."""
    def always_accept(draft_tokens, draft_probs, target_probs, generator):
        k = draft_tokens.shape[1]
        return torch.full((draft_tokens.shape[0],), k), torch.multinomial(target_probs[:, k], 1, generator=generator).squeeze(-1)

    monkeypatch.setattr("verispec.core.rows.rejection_sample", always_accept)
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(small_vocab_target, [3, 1, 2, 3, 1], params, 3)
    counts, _ = _histograms(small_vocab_target, params, "ngram", 1000, 3)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(3)) < ALPHA


def test_hybrid_looks_up_once_per_round(monkeypatch):
    """source, pending and propose share one n-gram lookup per round (the engine asks all three)."""
    import torch

    import verispec.proposers.ngram as ngram_module
    from verispec.core.sampling import SamplingParams
    from verispec.core.sequence import TokenSequence
    from verispec.proposers import HybridDrafter, LookupDrafter, NgramProposer

    class NoModel:
        model = type("OneSlot", (), {"slots": 1})()

        def start(self, *args):
            pass

        def pending(self, slot, seq):
            return 7

        def propose(self, rows):  # no row is the model's in this round
            assert rows == []
            return []

    calls = []
    real = ngram_module.find_match
    monkeypatch.setattr(ngram_module, "find_match", lambda *a: calls.append(1) or real(*a))
    hybrid = HybridDrafter(LookupDrafter([NgramProposer(max_ngram=3, min_ngram=1, min_confident=2)]), NoModel())
    seq = TokenSequence([1, 2, 3, 1, 2], 16, torch.device("cpu"))
    hybrid.start(0, seq, SamplingParams(), torch.Generator())
    assert hybrid.source(0, seq) == "ngram" and hybrid.pending(0, seq) == 0 and len(calls) == 1
    assert hybrid.propose([(0, seq, 4, None)])[0].tokens.tolist() == [3, 1, 2] and len(calls) == 1
    seq.extend([9], torch.tensor([9]))  # the next round: a fresh lookup, no match now
    assert hybrid.source(0, seq) == "model" and hybrid.pending(0, seq) == 7 and len(calls) == 2


def test_ngram_names_its_source_by_match_length():
    """Long matches, short matches and no match are separate sources for the k policy."""
    import torch

    from verispec.core.sampling import SamplingParams
    from verispec.core.sequence import TokenSequence
    from verispec.proposers import NgramProposer

    ngram = NgramProposer(max_ngram=4, min_ngram=1, min_confident=3)
    seq = TokenSequence([1, 2, 3, 4, 9, 1, 2, 3], 32, torch.device("cpu"))
    ngram.start(seq, SamplingParams(), torch.Generator())
    assert ngram.source(seq) == "ngram"  # [1, 2, 3] occurred before
    seq.extend([7, 3], torch.tensor([7, 3]))
    assert ngram.source(seq) == "ngram-short"  # only [3] did
    seq.extend([8], torch.tensor([8]))
    assert ngram.source(seq) == "none"


def test_ngram_auto_keeps_a_policy_per_match_kind(models):
    from tiny import make_engine

    target, _ = models
    prompt = [5, 6, 7, 8, 9, 10] * 8 + [3, 5]
    plain = make_engine(target).generate(prompt, max_new_tokens=60).token_ids
    eng = make_engine(target, k="auto", drafter="ngram")
    assert eng.generate(prompt, max_new_tokens=60).token_ids == plain
    assert set(eng.k_policy.by_source) <= {"ngram", "ngram-short", "none"} and "ngram" in eng.k_policy.by_source
