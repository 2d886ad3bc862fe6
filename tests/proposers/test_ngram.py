"""n-gram (prompt lookup) and hybrid drafters: lookup edge cases, greedy identity, distribution, EOS, limits."""

from __future__ import annotations

import pytest
import torch
from stats_util import chi2_pvalue, generation_histograms
from test_engine import _exact_marginals
from tiny import make_engine, perturbed, tiny_qwen2

from verispec import SamplingParams
from verispec.proposers.ngram import NgramIndex

ALPHA = 1e-4


def _scan(tokens: list[int], max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """The lookup by definition: for n from the longest down, the latest earlier start of the last n tokens with
    a token after it; (where its continuation starts, n)."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        for i in range(L - n - 1, -1, -1):
            if tokens[i : i + n] == tokens[L - n :]:
                return i + n, n
    return 0, 0


def _continuation(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    at, n = NgramIndex(max_ngram).match(tokens, min_ngram)
    return (tokens[at : at + k], n) if n else ([], 0)


def test_lookup_edges():
    assert _continuation([1, 2, 3], 4, 3, 1) == ([], 0)  # no earlier occurrence
    assert _continuation([5], 4, 3, 1) == ([], 0)  # too short
    # longest suffix first, most recent occurrence, continuation capped at k
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 0, 1, 2, 3]
    assert _continuation(toks, 2, 3, 1) == ([7, 8], 3)
    assert _continuation(toks, 10, 3, 1) == ([7, 8, 0, 1, 2, 3], 3)
    # a match whose continuation runs to the end of the sequence is cut there
    assert _continuation([4, 5, 4, 5], 5, 2, 1) == ([4, 5], 2)
    assert _continuation([4, 5, 6, 4], 3, 3, 2) == ([], 0)  # min_ngram respected
    assert _continuation([7, 7, 7], 2, 3, 1) == ([7], 2)  # overlapping: [7, 7] at 0, followed by 7
    assert NgramIndex(4).guess([3, 1, 2, 3]) == 1 and NgramIndex(4).guess([3, 1, 2]) == 2  # else the last again
    with pytest.raises(ValueError):
        from verispec.proposers import NgramProposer

        NgramProposer(max_ngram=1, min_ngram=2)


@pytest.mark.parametrize("max_ngram,min_ngram", [(4, 1), (3, 2), (1, 1)])
def test_index_kept_up_to_date_matches_the_scan(max_ngram, min_ngram):
    """Looked up after every round of a growing sequence (rounds append 1-4 tokens), after a cut, and on another
    list, the index finds what a scan of the whole sequence finds."""
    rng = torch.Generator().manual_seed(max_ngram * 10 + min_ngram)
    index = NgramIndex(max_ngram)
    for vocab in (3, 12):  # small vocabularies repeat often: long and short matches, and none
        ids = torch.randint(vocab, (5,), generator=rng).tolist()
        for _ in range(120):
            assert index.match(ids, min_ngram) == _scan(ids, max_ngram, min_ngram)
            ids.extend(torch.randint(vocab, (int(torch.randint(1, 5, (1,), generator=rng)),), generator=rng).tolist())
        del ids[len(ids) // 2 :]  # a cut (a stop) leaves a shorter list: indexed anew
        assert index.match(ids, min_ngram) == _scan(ids, max_ngram, min_ngram)
        other = list(reversed(ids))  # another list: indexed anew
        assert index.match(other, min_ngram) == _scan(other, max_ngram, min_ngram)


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
    eng = make_engine(target, k=2, drafter=drafter, slots=8)
    counts, drafted, _ = generation_histograms(eng, [3, 1, 2, 3, 1], params, n, steps, target.config.vocab_size)
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


def test_ngram_sampling_marginals_with_lookup_texts(small_vocab_target):
    """Drafts from a request's lookup text (the prompt has no repeat of its own): tokens 1-3 follow the target's
    exact marginals. N = 3000, V = 8; false-failure probability 3 x ALPHA."""
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(small_vocab_target, [3, 1, 2], params, 3)
    eng = make_engine(small_vocab_target, k=2, drafter="ngram", slots=8)
    counts, drafted, _ = generation_histograms(eng, [3, 1, 2], params, 3000, 3, small_vocab_target.config.vocab_size,
                                               lookup_texts=((5, 1, 2, 6, 7, 1, 2, 4, 4),))
    assert drafted > 1000
    for pos in range(3):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_ngram_negative_control_fails(small_vocab_target, monkeypatch):
    """An always-accept verifier with n-gram drafts emits the copied tokens, not p: the test must fail."""
    def always_accept(draft_tokens, draft_probs, target_probs, rng):
        k = draft_tokens.shape[1]
        bonus = torch.multinomial(target_probs[:, k], 1, generator=rng).squeeze(-1)
        return torch.full((draft_tokens.shape[0],), k), bonus

    monkeypatch.setattr("verispec.core.rows.rejection_sample", always_accept)
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(small_vocab_target, [3, 1, 2, 3, 1], params, 3)
    counts, _ = _histograms(small_vocab_target, params, "ngram", 1000, 3)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(3)) < ALPHA


def test_hybrid_takes_the_model_where_the_lookup_has_no_match():
    """source, pending and propose agree within a round; the next round looks up the grown sequence."""
    import torch

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

    hybrid = HybridDrafter(LookupDrafter([NgramProposer(max_ngram=3, min_ngram=1, min_confident=2)]), NoModel())
    seq = TokenSequence([1, 2, 3, 1, 2], 16, torch.device("cpu"))
    hybrid.start(0, seq, SamplingParams(), torch.Generator())
    assert hybrid.source(0, seq) == "ngram" and hybrid.pending(0, seq) == 0
    assert hybrid.propose([(0, seq, 4, None)])[0].tokens.tolist() == [3, 1, 2]
    seq.extend([9], torch.tensor([9]))  # the next round: a fresh lookup, no match now
    assert hybrid.source(0, seq) == "model" and hybrid.pending(0, seq) == 7


def test_hybrid_drafts_short_matches_while_the_model_lags_far_behind():
    """A short match drafts where the draft model would first have to catch up on more than LAG_MAX tokens (a
    long prompt it has not read, a long run of confident lookups) or cannot draft, the model where it lags less; a
    confident match drafts either way, and the model where there is no match. A short match that finds nothing
    leaves the row undrafted: the lagging model is not caught up for it."""
    import torch

    from verispec.core.draft import Draft
    from verispec.core.sampling import SamplingParams
    from verispec.core.sequence import TokenSequence
    from verispec.proposers import HybridDrafter, LookupDrafter, NgramProposer, SuffixProposer
    from verispec.proposers.hybrid import LAG_MAX

    class Lagging:
        model = type("OneSlot", (), {"slots": 1})()
        lag, can_draft = 0, True

        def start(self, *args):
            pass

        def source(self, slot, seq):
            return "model" if self.can_draft else "none"

        def pending(self, slot, seq):
            return self.lag

        def catch_up(self, slot, seq, limit=None):
            raise AssertionError("a lookup row's model is not caught up")

        def propose(self, rows):  # no row is the model's in these rounds
            assert rows == []
            return []

    model = Lagging()
    hybrid = HybridDrafter(LookupDrafter([NgramProposer(max_ngram=3, min_ngram=1, min_confident=3)]), model)
    seq = TokenSequence([1, 2, 3, 9, 1], 16, torch.device("cpu"))  # [1] occurred before: a short match
    hybrid.start(0, seq, SamplingParams(), torch.Generator())
    for lag, can_draft, source in ((LAG_MAX, True, "model"), (0, False, "ngram-short"),
                                   (LAG_MAX + 1, True, "ngram-short")):
        model.lag, model.can_draft = lag, can_draft
        assert hybrid.source(0, seq) == source
    assert hybrid.pending(0, seq) == 0 and hybrid.catch_up(0, seq) == 0
    assert hybrid.propose([(0, seq, 3, None)])[0].tokens.tolist() == [2, 3, 9]
    seq.extend([2, 3], torch.tensor([2, 3]))  # [1, 2, 3] occurred before: confident at any lag
    for lag in (0, LAG_MAX + 1):
        model.lag = lag
        assert hybrid.source(0, seq) == "ngram"
    seq.extend([7], torch.tensor([7]))  # no match: the model at any lag
    assert hybrid.source(0, seq) == "model"

    class Finds(SuffixProposer):  # a short match whose walk finds no draft (as at another match depth)
        def propose(self, seq, k):
            return Draft(seq.device_ids.new_empty(0), None, "suffix-short")

    hybrid = HybridDrafter(LookupDrafter([Finds(min_confident=3)]), model)
    seq = TokenSequence([1, 2, 3, 9, 1], 16, torch.device("cpu"))
    hybrid.start(0, seq, SamplingParams(), torch.Generator())
    model.lag = LAG_MAX + 1
    assert hybrid.source(0, seq) == "suffix-short"
    assert hybrid.propose([(0, seq, 3, None)])[0].tokens.numel() == 0  # Lagging would fail a catch-up or propose
    hybrid.observe(0, seq, 0, 0)  # the lookup's round, not the model's

    class Nothing(NgramProposer):  # a confident match, no draft drawn from it
        def propose(self, seq, k):
            return Draft(seq.device_ids.new_empty(0), None, "ngram")

    hybrid = HybridDrafter(LookupDrafter([Nothing(max_ngram=3, min_ngram=1, min_confident=2)]), model)
    seq = TokenSequence([1, 2, 3, 1, 2], 16, torch.device("cpu"))  # [1, 2] occurred before
    hybrid.start(0, seq, SamplingParams(), torch.Generator())
    assert hybrid.source(0, seq) == "ngram"
    assert hybrid.propose([(0, seq, 3, None)])[0].tokens.numel() == 0  # no fallback to a model that far behind


def test_hybrid_falls_back_to_a_caught_up_model():
    """A confident lookup (its source) that drafts nothing hands the row to the draft model, which the engine did not
    catch up for it: the hybrid catches it up first, so the model's first draft step feeds one or two tokens, as
    every draft step after a catch-up does (a seeded row's q must not depend on how much its first step feeds)."""
    import torch
    from tiny import tiny_qwen2

    from verispec.backends import HFModel
    from verispec.core.draft import Draft
    from verispec.core.sampling import SamplingParams
    from verispec.core.sequence import TokenSequence
    from verispec.proposers import DraftModel, HybridDrafter, LookupDrafter, NgramProposer

    class Empty(NgramProposer):  # a match found, no draft drawn from it (a suffix walk below its min_prob)
        def propose(self, seq, k):
            return Draft(seq.device_ids.new_empty(0), None, "ngram")

    class Feeds(HFModel):
        def forward_rows(self, slots, feeds, *args, **kwargs):
            self.widths.append([f.numel() for f in feeds])
            return super().forward_rows(slots, feeds, *args, **kwargs)

    draft = Feeds(tiny_qwen2(3, vocab_size=16))
    draft.widths = []
    hybrid = HybridDrafter(LookupDrafter([Empty(max_ngram=3, min_ngram=1, min_confident=2)]), DraftModel(draft, 16))
    seq = TokenSequence([1, 2, 3, 4, 5, 6, 1, 2], 32, torch.device("cpu"))
    hybrid.start(0, seq, SamplingParams(), torch.Generator())
    assert hybrid.source(0, seq) == "ngram" and hybrid.pending(0, seq) == 0  # the engine catches nothing up
    out = hybrid.propose([(0, seq, 3, None)])[0]
    assert out.source == "model" and out.tokens.numel() == 3
    assert draft.widths == [[7], [1], [1], [1]]  # the catch-up, then a first step over the last committed token


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


def test_ngram_searches_the_lookup_texts_beside_the_sequence():
    """A request's other texts are searched with the sequence: the longest match wins wherever it is, the
    sequence's on a tie; a match found only in a text drafts that text's continuation; the texts go with the
    generation."""
    from verispec.core.sequence import TokenSequence
    from verispec.proposers import NgramProposer

    def seq_of(ids):
        return TokenSequence(ids, 64, torch.device("cpu"))

    ngram = NgramProposer(max_ngram=4, min_ngram=2, min_confident=3)
    seq = seq_of([9, 3, 4])
    ngram.start(seq, SamplingParams(), torch.Generator())
    assert ngram.source(seq) == "none"  # nothing in the sequence alone
    ngram.start(seq, SamplingParams(), torch.Generator(), [[1, 3, 4, 7, 8, 2], [5]])
    assert (ngram.propose(seq, 3).tokens.tolist(), ngram.last_match) == ([7, 8, 2], 2)  # [3, 4] in the text
    assert ngram.source(seq) == "ngram-short"
    longer = seq_of([5, 9, 3, 4, 6, 9, 3, 4])  # [9, 3, 4] in the sequence beats [3, 4] in the text
    ngram.start(longer, SamplingParams(), torch.Generator(), [[1, 3, 4, 7, 8, 2]])
    assert ngram.propose(longer, 2).tokens.tolist() == [6, 9] and ngram.source(longer) == "ngram"
    ngram.start(longer, SamplingParams(), torch.Generator(), [[0, 9, 3, 4, 7]])  # a tie: the sequence's
    assert ngram.propose(longer, 1).tokens.tolist() == [6]
    ngram.start(longer, SamplingParams(), torch.Generator(), [[6, 9, 3, 4, 7, 7]])  # longer in the text
    assert ngram.propose(longer, 2).tokens.tolist() == [7, 7] and ngram.last_match == 4
    whole = seq_of([9, 3, 4])  # a text holding the whole sequence: a full-length match, clipped at the text's end
    ngram.start(whole, SamplingParams(), torch.Generator(), [[9, 3, 4, 7]])
    assert (ngram.propose(whole, 4).tokens.tolist(), ngram.source(whole)) == ([7], "ngram")
    ngram.end()
    assert ngram.source(whole) == "none"  # the finished generation's texts are gone


@pytest.mark.parametrize("drafter", ["ngram", "hybrid"])
def test_greedy_identical_with_lookup_texts(models, drafter):
    """Drafts copied from a request's lookup texts: the plain answer itself (drafts accepted) and a text that
    matches the prompt's end with the wrong continuation (drafts rejected) give the plain tokens."""
    from verispec.decoding.request import Request

    target, draft = models
    prompt = list(range(2, 20))
    plain = make_engine(target).generate(prompt, max_new_tokens=30).token_ids
    right, wrong = tuple(prompt[-3:] + plain), tuple(prompt[-3:] + [(t + 1) % 64 for t in plain])
    for text, copies in ((right, True), (wrong, False)):
        eng = make_engine(target, draft, k=8, drafter=drafter)
        out = eng.generate(Request(prompt_ids=tuple(prompt), max_new_tokens=30, lookup_texts=(text,)))
        assert out.token_ids == plain
        if drafter == "ngram":
            assert out.stats.accepted >= 20 if copies else out.stats.accepted < out.stats.drafted / 2
            assert out.stats.drafted >= 8
