"""Suffix-tree drafter: the trie's counts, drafting rules, greedy identity, distribution, EOS, limits, the
history across generations and its bounded memory."""

from __future__ import annotations

import random

import pytest
import torch
from stats_util import chi2_pvalue, generation_histograms
from test_engine import _exact_marginals
from tiny import make_engine, tiny_qwen2

from verispec import SamplingParams
from verispec.backends import HFModel
from verispec.core.sequence import TokenSequence
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.proposers.lookup import LookupDrafter
from verispec.proposers.suffix import SuffixHistory, SuffixProposer, SuffixTrie, _Text

ALPHA = 1e-4
REPETITIVE = [5, 6, 7, 8, 9, 10, 5, 6, 7, 8, 9, 10, 5, 6, 7]
DISTINCT = list(range(2, 22))  # no token repeats: nothing to draft from but the history


class Recording(SuffixProposer):
    """A SuffixProposer that keeps every draft it proposed."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.drafts: list[list[int]] = []

    def propose(self, seq, k):
        draft = super().propose(seq, k)
        self.drafts.append(draft.tokens.tolist())
        return draft


def engine(target, proposer=None, k=4, eos=()) -> SpeculativeEngine:
    """A one-slot engine drafting with `proposer` (None: plain decoding)."""
    drafter = None if proposer is None else LookupDrafter([proposer])
    return SpeculativeEngine(HFModel(target), drafter, eos_token_ids=eos, k=k,
                             auto_policy=CostAwareK())


def seq_of(prompt: list[int]) -> TokenSequence:
    return TokenSequence(prompt, len(prompt) + 64, torch.device("cpu"))


def grow(seq: TokenSequence, ids: list[int]) -> None:
    seq.extend(ids, torch.tensor(ids, dtype=torch.long))


def started(proposer: SuffixProposer, seq: TokenSequence) -> SuffixProposer:
    proposer.start(seq, SamplingParams(), torch.Generator())
    return proposer


# -- the trie ------------------------------------------------------------------------------------------

def _brute_continuations(texts, context, depth):
    """{token: count} of what followed `context` in the texts, counting substrings of <= depth tokens."""
    out: dict[int, int] = {}
    n = len(context)
    if n + 1 > depth:
        return out
    for t in texts:
        for i in range(len(t) - n):
            if t[i : i + n] == context:
                out[t[i + n]] = out.get(t[i + n], 0) + 1
    return out


def test_trie_counts_equal_brute_force():
    """Texts added whole or token by token, some removed again: every context's continuation counts equal a
    brute-force count over the texts left (lazy nodes expanded on a second occurrence, removal exact)."""
    rng = random.Random(0)
    for trial in range(150):
        depth, vocab = rng.randint(2, 7), rng.randint(1, 4)
        trie, texts = SuffixTrie(depth), []
        for n in range(rng.randint(1, 5)):
            ids = [rng.randrange(vocab) for _ in range(rng.randint(0, 30))]
            text = _Text([] if n % 2 else ids, n << 40)
            if n % 2:  # the way a generation's own text grows
                active = [trie.root]
                for j, tok in enumerate(ids):
                    text.ids.append(tok)
                    active = trie.append(active, text, j)
            else:
                trie.add(text)
            texts.append(text)
            if len(texts) > 1 and rng.random() < 0.4:
                trie.remove(texts.pop(rng.randrange(len(texts))))
            for _ in range(20):
                src = rng.choice(texts).ids or [0]
                a = rng.randrange(len(src))
                context = src[a : rng.randint(a, min(len(src), a + depth))]
                assert trie.continuations(context) == _brute_continuations([t.ids for t in texts], context, depth)
        for text in texts:
            trie.remove(text)
        assert trie.size() == 1, trial  # all removed: only the root is left


def test_trie_spells_out_only_repeated_paths():
    """A text with no repeats costs about one node per token, not max_depth of them."""
    trie = SuffixTrie(24)
    trie.add(_Text(list(range(1000)), 0))
    assert trie.size() == 1001


# -- drafting rules ------------------------------------------------------------------------------------

def test_draft_follows_most_frequent_then_most_recent():
    seq = seq_of([1, 2, 3, 5, 1, 2, 3, 6, 1, 2, 4, 7, 9, 1, 2])
    # after [1, 2]: 3 twice (the older), 4 once; after [1, 2, 3]: 5 and 6 once each, 6 the more recent
    assert started(SuffixProposer(spec_factor=4.0), seq).propose(seq, 3).tokens.tolist() == [3, 6, 1]
    seq = seq_of([1, 2, 5, 1, 2, 6, 8, 1, 2])
    assert started(SuffixProposer(spec_factor=4.0), seq).propose(seq, 2).tokens.tolist() == [6, 8]


def test_draft_length_from_confidence():
    seq = seq_of([1, 2, 3, 8, 1, 2, 4, 8, 1, 2, 5, 8, 6, 1, 2])  # after [1, 2]: 3, 4, 5 once each
    assert started(SuffixProposer(min_prob=0.5), seq).source(seq) == "none"
    p = started(SuffixProposer(min_prob=0.3, spec_factor=8.0), seq)
    assert p.propose(seq, 8).tokens.tolist() == [5, 8, 6, 1, 2]  # p = 1/3 then shares of 1: kept
    assert started(SuffixProposer(min_prob=0.3, spec_factor=1.0), seq).propose(seq, 8).tokens.tolist() == [5, 8]
    seq = seq_of([4, 9, 4])  # a match of one token drafts spec_factor x 1 of them
    assert started(SuffixProposer(), seq).propose(seq, 8).tokens.tolist() == [9]


def test_names_its_source_by_match_length():
    seq = seq_of([1, 2, 3, 4, 9, 1, 2, 3])
    p = started(SuffixProposer(min_confident=3), seq)
    assert p.source(seq) == "suffix"  # [1, 2, 3] occurred before
    grow(seq, [7, 3])
    assert p.source(seq) == "suffix-short"  # only [3] did
    grow(seq, [8])
    assert p.source(seq) == "none" and p.propose(seq, 4).tokens.numel() == 0


def test_empty_history_and_match_without_continuation():
    p = started(SuffixProposer(), seq_of(DISTINCT))
    assert p.source(p._seq) == "none" and p.propose(p._seq, 4).tokens.numel() == 0  # nothing anywhere
    p = SuffixProposer()
    p.add_history([1, 2, 3, 4])
    seq = seq_of([9, 3, 4])  # [3, 4] occurred only at the very end of a text: no continuation
    assert started(p, seq).source(seq) == "none" and p.propose(seq, 4).tokens.numel() == 0
    p.add_history([5, 4, 1])
    assert p.propose(seq, 4).tokens.tolist() == [1]  # the shorter match [4] has one
    assert p.source(seq) == "suffix-short"


def test_lookup_texts_are_counted_beside_the_sequence():
    """A request's other texts are counted in a trie of their own (every context's counts as a brute-force count),
    searched with the sequence's: a match found only there drafts its continuation; a tie goes to the sequence."""
    seq, texts = seq_of([9, 3, 4]), [[1, 3, 4, 7, 8, 2], [5, 4, 6]]
    assert started(SuffixProposer(), seq).source(seq) == "none"  # nothing in the sequence alone
    p = SuffixProposer(spec_factor=4.0, history_tokens=0)
    p.start(seq, SamplingParams(), torch.Generator(), texts)
    for context in ([], [3], [3, 4], [4], [9, 3]):
        assert p._texts_trie.continuations(context) == _brute_continuations(texts, context, p.max_depth)
    assert p.propose(seq, 3).tokens.tolist() == [7, 8, 2]  # [3, 4] matched in the first text
    grow(seq, [6, 9, 3])  # the sequence now holds [9, 3] -> 4, as does nothing else: its own continuation
    assert p.propose(seq, 1).tokens.tolist() == [4]
    tie = seq_of([2, 5, 1, 2])  # after [2]: 5 in the sequence, 6 in the text, once each
    p.start(tie, SamplingParams(), torch.Generator(), [[2, 6]])
    assert p.propose(tie, 1).tokens.tolist() == [5]


def test_texts_extended_by_the_next_turn_are_counted_incrementally():
    """An agent's next turn: the sequence's index is reused whatever its texts; texts that begin with the last turn's
    add only the new ones to their trie; others replace them; none forget them. Drafts see the texts added."""
    p = SuffixProposer(history_tokens=0)
    p.start(seq_of([1, 2, 3]), SamplingParams(), torch.Generator(), [[3, 7, 8]])
    trie, texts_trie = p._trie, p._texts_trie
    seq = seq_of([1, 2, 3, 5, 3])
    p.start(seq, SamplingParams(), torch.Generator(), [[3, 7, 8], [5, 3, 6]])
    assert p._trie is trie and p._texts_trie is texts_trie  # both kept: the new text added, the first not again
    assert p._texts_trie.continuations([3]) == {7: 1, 6: 1} and p._trie.continuations([3]) == {5: 1}
    assert p.propose(seq, 1).tokens.tolist() == [6]  # [5, 3] -> 6 in the new text (longest match)
    p.start(seq_of([1, 2, 3, 5, 3]), SamplingParams(), torch.Generator(), [[3, 9]])
    assert p._texts_trie is not texts_trie and p._texts_trie.continuations([3]) == {9: 1}
    p.start(seq_of([1, 2, 3, 5, 3]), SamplingParams(), torch.Generator())
    assert p._texts_trie.continuations([3]) == {}


def test_invalid_parameters():
    for kwargs in ({"max_depth": 1}, {"spec_factor": 0}, {"min_prob": 1.5}, {"min_confident": 0},
                   {"history_tokens": -1}):
        with pytest.raises(ValueError):
            SuffixProposer(**kwargs)


def test_rounds_update_incrementally(monkeypatch):
    """Each round counts only the tokens committed since the last one (no rebuild per round)."""
    calls = []
    real = SuffixTrie.append
    monkeypatch.setattr(SuffixTrie, "append", lambda *a: calls.append(1) or real(*a))
    rng = random.Random(3)
    seq = seq_of([rng.randrange(50) for _ in range(4000)])
    p = started(SuffixProposer(), seq)
    assert len(calls) == 4000
    for _ in range(20):
        calls.clear()
        p.source(seq)
        p.propose(seq, 8)
        grow(seq, [rng.randrange(50) for _ in range(3)])
        p.observe(seq, 3, 2)
        p.source(seq)
        assert len(calls) == 3


# -- the history ---------------------------------------------------------------------------------------

def test_history_is_bounded_and_evicted_text_is_forgotten():
    p = SuffixProposer(history_tokens=50)
    p.add_history(list(range(100, 130)))
    seq = seq_of([1, 100, 101, 102])
    assert started(p, seq).propose(seq, 4).tokens.tolist() == [103, 104, 105]
    rng = random.Random(1)
    for _ in range(200):
        p.add_history([rng.randrange(1000, 2000) for _ in range(rng.randint(1, 40))])
        starts = sum(p.history.continuations([]).values())  # one per token held
        assert starts == p.history.tokens <= 50 and p.history.trie.size() <= 50 * p.max_depth + 1
    assert p.history.continuations([100, 101]) == {}
    started(p, seq)
    assert p.source(seq) == "none" and p.propose(seq, 4).tokens.numel() == 0
    p.add_history(list(range(500, 600)))  # longer than the budget: its last 50 tokens are kept
    assert p.history.tokens == 50 and p.history.continuations([549]) == {} and p.history.continuations([550]) == {551: 1}
    p.history.clear()
    assert p.history.tokens == 0 and p.history.trie.size() == 1


def test_truncated_output_enters_history_as_kept():
    """A stop string cut the output: the next generation drafts the kept tokens, never the cut ones, and
    its own index holds none of them."""
    p = SuffixProposer()
    seq = started(p, seq_of(DISTINCT))._seq
    grow(seq, [40, 41, 42, 43, 44, 45])
    p.propose(seq, 4)  # indexed 40..45
    seq.truncate(len(DISTINCT) + 3)  # the stop kept 40, 41, 42
    nxt = seq_of(DISTINCT + [40, 41, 42, 50])  # the next turn: prompt = the kept conversation + more
    started(p, nxt)
    assert p._trie.continuations([42]) == {50: 1} and p._trie.continuations([43]) == {}
    again = seq_of(DISTINCT)
    assert started(p, again).propose(again, 8).tokens.tolist() == [40, 41, 42]  # the history's kept output


def test_next_turn_reuses_the_index():
    p = SuffixProposer()
    first = started(p, seq_of([1, 2, 3, 1, 2]))._seq
    grow(first, [3, 4])
    p.propose(first, 4)
    trie = p._trie
    second = seq_of([1, 2, 3, 1, 2, 3, 4, 9, 1, 2, 3])
    started(p, second)
    assert p._trie is trie
    ids = second.ids
    for a in range(len(ids)):
        for b in range(a, len(ids) + 1):
            assert p._trie.continuations(ids[a:b]) == _brute_continuations([ids], ids[a:b], p.max_depth)


# -- through the engine --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(1)


@pytest.mark.parametrize("k", [1, 3, 8, "auto"])
@pytest.mark.parametrize("prompt", [REPETITIVE, [1, 2, 3], list(range(2, 50))])
def test_greedy_identical_to_plain(target, k, prompt):
    plain = engine(target).generate(prompt, max_new_tokens=40)
    spec = engine(target, SuffixProposer(), k=k).generate(prompt, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    if prompt is REPETITIVE and k != "auto":  # auto drafts only where measured costs say it pays
        assert spec.stats.drafted > 0 and spec.stats.accepted > 0


def test_greedy_identical_with_lookup_texts(target):
    """Drafts copied from a request's lookup texts: the plain answer itself (every draft accepted) and a text that
    matches the prompt's end with the wrong continuation (every draft rejected) give the plain tokens."""
    from verispec.decoding.request import Request

    plain = engine(target).generate(DISTINCT, max_new_tokens=30).token_ids
    right, wrong = tuple(DISTINCT[-3:] + plain), tuple(DISTINCT[-3:] + [(t + 1) % 64 for t in plain])
    for text, copies in ((right, True), (wrong, False)):
        p = Recording(history_tokens=0, spec_factor=4.0)
        out = engine(target, p, k=8).generate(Request(prompt_ids=DISTINCT, max_new_tokens=30, lookup_texts=(text,)))
        assert out.token_ids == plain
        assert p.drafts[0] == list(text[3:11]) and out.stats.drafted >= 8
        assert out.stats.accepted >= 20 if copies else out.stats.accepted < out.stats.drafted / 2


def test_auto_keeps_a_policy_per_match_kind(target):
    prompt = [5, 6, 7, 8, 9, 10] * 8 + [3, 5]
    plain = engine(target).generate(prompt, max_new_tokens=60).token_ids
    eng = engine(target, SuffixProposer(), k="auto")
    assert eng.generate(prompt, max_new_tokens=60).token_ids == plain
    assert set(eng.k_policy.by_source) <= {"suffix", "suffix-short", "none"} and "suffix" in eng.k_policy.by_source


def test_second_generation_drafts_from_the_first(target):
    plain = engine(target).generate(DISTINCT, max_new_tokens=30).token_ids
    p = Recording()
    eng = engine(target, p, k=8)
    first = eng.generate(DISTINCT, max_new_tokens=30)
    p.drafts.clear()
    second = eng.generate(DISTINCT, max_new_tokens=30)
    assert first.token_ids == second.token_ids == plain
    assert p.drafts[0] == plain[:8]  # the first round already drafts the first output
    assert second.stats.accepted >= 24 > first.stats.accepted
    fresh = Recording(history_tokens=0)
    engine(target, fresh, k=8).generate(DISTINCT, max_new_tokens=30)
    assert fresh.drafts[0] == []  # without a history the first round has nothing to draft


def test_stop_string_cut_between_generations(target):
    plain = engine(target).generate(DISTINCT, max_new_tokens=30).token_ids
    p = Recording()
    eng = engine(target, p, k=8)
    cut = eng.generate(DISTINCT, max_new_tokens=30, stop=lambda gen: 5 if len(gen) >= 5 else None)
    assert cut.token_ids == plain[:5] and cut.finish_reason == "stop"
    p.drafts.clear()
    assert eng.generate(DISTINCT, max_new_tokens=30).token_ids == plain
    assert p.drafts[0] == plain[:5]  # the kept output, not what the stop cut


def test_eos_inside_a_drafted_continuation(target):
    """The history drafts past an EOS: the engine stops at it, as plain decoding does."""
    plain = engine(target).generate(DISTINCT, max_new_tokens=30).token_ids
    for eos_pos in (1, 6):
        eos = plain[eos_pos]
        p = Recording()
        engine(target, p, k=8).generate(DISTINCT, max_new_tokens=30)  # history: the output without EOS
        p.drafts.clear()
        out = engine(target, p, k=8, eos=[eos]).generate(DISTINCT, max_new_tokens=30)
        assert eos in p.drafts[0][:-1]  # the draft went on past the EOS
        assert out.token_ids == plain[: plain.index(eos) + 1] and out.finish_reason == "stop"


def test_k_beyond_the_tokens_left(target):
    plain = engine(target).generate(DISTINCT, max_new_tokens=30).token_ids
    p = SuffixProposer()
    eng = engine(target, p, k=8)
    eng.generate(DISTINCT, max_new_tokens=30)
    for max_new in (1, 2, 5):
        out = eng.generate(DISTINCT, max_new_tokens=max_new)
        assert out.token_ids == plain[:max_new] and out.finish_reason == "length"


# -- sampling ------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_vocab_target():
    return tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)


PROMPT = [3, 1, 2, 3, 1]


def _histograms(target, params, n, steps):
    """Token counts per position over n generations, eight at a time, their lookups sharing one history: later
    ones draft from earlier ones' outputs too."""
    history = SuffixHistory()
    lookups = [SuffixProposer(min_prob=0.0, history=history) for _ in range(8)]
    eng = make_engine(target, drafter=LookupDrafter(lookups), k=2, slots=8)
    counts, drafted, _ = generation_histograms(eng, PROMPT, params, n, steps, target.config.vocab_size)
    return counts, drafted


def test_sampling_marginals_match_target(small_vocab_target):
    """Deterministic drafts from the sequence and the history under sampling: tokens 1-3 follow the
    target's exact marginals. N = 3000, V = 8; false-failure probability 3 x ALPHA = 3e-4."""
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(small_vocab_target, PROMPT, params, 3)
    counts, drafted = _histograms(small_vocab_target, params, 3000, 3)
    assert drafted > 1000  # drafts were really made
    for pos in range(3):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_sampling_marginals_with_lookup_texts(small_vocab_target):
    """Drafts from a request's lookup text alone (no history): tokens 1-3 follow the target's exact marginals.
    N = 3000, V = 8; false-failure probability 3 x ALPHA."""
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(small_vocab_target, PROMPT, params, 3)
    lookups = [SuffixProposer(min_prob=0.0, history_tokens=0) for _ in range(8)]  # eight rows at once, each alone
    eng = make_engine(small_vocab_target, drafter=LookupDrafter(lookups), k=3, slots=8)
    counts, drafted, _ = generation_histograms(eng, PROMPT, params, 3000, 3, small_vocab_target.config.vocab_size,
                                               lookup_texts=((3, 1, 5, 6, 3, 1, 5, 6, 7),))
    assert drafted > 3000
    for pos in range(3):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_sampling_negative_control_fails(small_vocab_target, monkeypatch):
    """An always-accept verifier emits the drafted tokens, not p: the same test must fail."""
    def always_accept(draft_tokens, draft_probs, target_probs, rng):
        k = draft_tokens.shape[1]
        bonus = torch.multinomial(target_probs[:, k], 1, generator=rng).squeeze(-1)
        return torch.full((draft_tokens.shape[0],), k), bonus

    monkeypatch.setattr("verispec.core.rows.rejection_sample", always_accept)
    params = SamplingParams(temperature=1.0)
    exact = _exact_marginals(small_vocab_target, PROMPT, params, 3)
    counts, _ = _histograms(small_vocab_target, params, 1000, 3)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(3)) < ALPHA
