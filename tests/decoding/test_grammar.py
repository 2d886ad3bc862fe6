"""Structured output under speculation (verispec.core.grammar): the target's distribution masked by the grammar at
every position, whatever drafts it. Per-position marginals against enumeration of masked plain sampling, with a
sampled draft model and with a deterministic drafter proposing forbidden tokens; a negative control (a sampled
draft cut before its forbidden token, as a one-hot one may be) that must fail; greedy answers identical to plain
decoding under the same grammar; rows of different grammars in one batch as alone.

Resolution as tests/decoding/test_exactness.py (N = 6000 generations, 3 positions, TV < 0.03)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from stats_util import chi2_pvalue, seeded_results, total_variation
from test_exactness import ALPHA, PROMPT, SLOTS, STEPS, MappedLogits, N, assert_marginals, hf_logits
from tiny import as_model, perturbed, tiny_qwen2

from verispec.backends import HFModel
from verispec.core import grammar as grammar_module
from verispec.core.draft import Draft
from verispec.core.grammar import Constraint, GrammarRow, Grammars, apply_masks
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.proposers import DraftModel

TOKENS = [b"a", b"b", b"c", b"ab", b"ba", b"x", b"y", b"<eos>"]  # 8 ids; x and y never match, c only at the end
EOS = 7
PATTERN = "[ab]{4,8}c"  # no answer within 3 tokens can end: every generation reaches every position


class TinyTokenizer:
    """An 8-token vocabulary for llguidance (bytes per id, a greedy longest-match encoder)."""

    eos_token_id, bos_token_id, tokens, special_token_ids = EOS, None, TOKENS, [EOS]

    def __call__(self, text):
        data = text.encode() if isinstance(text, str) else text
        out, at = [], 0
        while at < len(data):
            best = max((i for i in range(EOS) if data.startswith(TOKENS[i], at)), key=lambda i: len(TOKENS[i]))
            out.append(best)
            at += len(TOKENS[best])
        return out


def tiny_grammars() -> Grammars:
    from llguidance import LLTokenizer, TokenizerWrapper

    return Grammars(lambda: LLTokenizer(TokenizerWrapper(TinyTokenizer()), n_vocab=8), 8)


GRAMMARS = tiny_grammars()
CONSTRAINT = Constraint.regex(PATTERN)


def masked_logits(logits_fn):
    """Enumeration's logits with each sequence's grammar mask (a sequence the grammar refused has weight 0)."""
    def fn(seqs):
        logits = logits_fn(seqs)
        masks = []
        for seq in seqs.tolist():
            row = GRAMMARS.row(CONSTRAINT)
            ok = row.matcher.consume_tokens(seq[len(PROMPT):]) if len(seq) > len(PROMPT) else True
            masks.append(row.walk([], sampled=False).masks[0] if ok else np.full(1, -1, dtype=np.int32))
        return apply_masks(logits, np.stack(masks))
    return fn


def exact_marginals(logits_fn, params: SamplingParams, whole: bool = False):
    """Each position's marginal under plain sampling, by enumeration; `whole`: also the distribution of the whole
    generation of STEPS tokens ([8 ** STEPS], index t0 t1 t2 read base 8)."""
    seqs, weights, marginals = torch.tensor([PROMPT]), torch.ones(1, dtype=torch.float64), []
    for _ in range(STEPS):
        joint = weights[:, None] * probs_from_logits(logits_fn(seqs), params).double()
        marginals.append(joint.sum(0))
        seqs = torch.cat([seqs.repeat_interleave(8, 0), torch.arange(8).repeat(len(seqs))[:, None]], 1)
        weights = joint.reshape(-1)
    return (marginals, weights) if whole else marginals


def histograms(engine, params, seed0, n=N, whole: torch.Tensor | None = None):
    """counts [STEPS, 8] of each position's tokens over n seeded generations; `whole` [8 ** STEPS] counts the
    generations themselves."""
    counts = torch.zeros(STEPS, 8, dtype=torch.long)
    for out in seeded_results(engine, PROMPT, params, n, STEPS, seed0, constraint=CONSTRAINT):
        for pos, tok in enumerate(out.token_ids[:STEPS]):
            counts[pos, tok] += 1
        if whole is not None:
            whole[sum(t * 8 ** (STEPS - 1 - p) for p, t in enumerate(out.token_ids[:STEPS]))] += 1
    return counts


class RandomDrafts:
    """A deterministic drafter (q one-hot) of k tokens drawn from the whole vocabulary, forbidden ones included."""

    def __init__(self):
        self.gen = torch.Generator().manual_seed(5)

    def start(self, seq, params, rng, texts=()):
        pass

    def source(self, seq):
        return "ngram"

    def propose(self, seq, k):
        return Draft(torch.randint(0, 8, (k,), generator=self.gen), None, "ngram")

    def observe(self, seq, drafted, accepted):
        pass

    def end(self):
        pass

    def reset(self):
        pass


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


def half_forbidden(logits):
    """A draft's q: half on 'a' (always allowed), half on 'x' (never): the rejected half must be followed by the
    residual norm(max(0, p - q)), which differs from p by a lot here."""
    out = torch.full_like(logits, float("-inf"))
    out[..., [0, 5]] = 0.0
    return out


class UnmaskedDraft(DraftModel):
    """A draft model that does not mask its q by the grammar: half its draws forbidden, the residual's test."""

    def start(self, slot, seq, params, rng, grammar=None, texts=()):
        super().start(slot, seq, params, rng, None, texts)


def _engine(target, drafter, k=2, during_pass=False, slots=1):
    """`during_pass`: the grammars walked while the pass runs, over whole drafts (as on CUDA); `slots`: sequences
    decoded at once (the target on the lean path where there are several)."""
    engine = SpeculativeEngine(as_model(target, slots), drafter, k=k, auto_policy=CostAwareK(),
                               grammars=GRAMMARS)
    engine.walk_during_pass = during_pass
    return engine


def test_masks_and_cuts():
    """A walk masks each verified position and cuts a one-hot draft before its first forbidden token, a sampled
    draft after it; the matcher ends where it began."""
    row = GRAMMARS.row(CONSTRAINT)
    walk = row.walk([3, 0, 5, 1], sampled=False)  # ab a x b: x is forbidden
    assert walk.keep == 2 and walk.masks.shape == (3, 1)
    allowed = [[t for t in range(8) if grammar_module.allowed(m, t)] for m in walk.masks]
    assert allowed == [[0, 1, 3, 4], [0, 1, 3, 4], [0, 1, 3, 4]]
    assert row.walk([3, 0, 5, 1], sampled=True).keep == 3
    row.commit([3, 3])  # abab: c may end it now
    assert [t for t in range(8) if grammar_module.allowed(row.walk([], sampled=False).masks[0], t)] == [0, 1, 2, 3, 4]
    logits = apply_masks(torch.zeros(1, 8), row.walk([2], sampled=False).masks[:1])
    assert torch.isinf(logits[0, [5, 6, 7]]).all() and torch.isfinite(logits[0, :5]).all()


def test_whole_drafts_walked_during_the_pass():
    """Walked while the pass runs, a draft stays whole and its masks run to its end, each verified position's the
    walk's own (the rows past the forbidden token repeat the last; past the output's end, anything)."""
    from verispec.core.grammar import walk_drafts

    row, draft = GRAMMARS.row(CONSTRAINT), Draft(torch.tensor([3, 3, 0, 5, 1, 1]), None, "ngram")  # abab a x b b
    row.commit([0])
    cut, cut_masks = walk_drafts([row, None], [draft, draft], [[3, 3, 0, 5, 1, 1], None])
    whole, masks = walk_drafts([row, None], [draft, draft], [[3, 3, 0, 5, 1, 1], None], cut=False)
    assert cut[0].tokens.tolist() == [3, 3, 0] and whole[0] is draft and whole[1] is draft and masks[1] is None
    assert masks[0].shape == (7, 1) and (masks[0][:4] == cut_masks[0]).all() and (masks[0][4:] == cut_masks[0][3]).all()
    assert [t for t in range(8) if grammar_module.allowed(masks[0][3], t)] == [0, 1, 2, 3, 4]  # c may end it there
    choice = GRAMMARS.row(Constraint.choice(["ab"]))
    _, ends = walk_drafts([choice], [Draft(torch.tensor([3, EOS, 5, 5]), None, "ngram")], [[3, EOS, 5, 5]], cut=False)
    assert ends[0].shape == (5, 1) and all(grammar_module.allowed(m, t) for m in ends[0][2:] for t in range(8))


@pytest.mark.parametrize("masked_q", [False, True])
def test_sampled_draft_marginals(pair, masked_q):
    """A sampled draft half of whose draws the grammar forbids (q unmasked: they are verified, rejected, and the next
    token comes from the residual), or whose q the grammar masks (all of them allowed): exact either way."""
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    exact, exact_whole = exact_marginals(masked_logits(hf_logits(target)), params, whole=True)
    assert max(float(m[[5, 6, 7]].sum()) for m in exact) == 0.0  # the grammar's mask is in the reference
    drafter = (DraftModel if masked_q else UnmaskedDraft)(MappedLogits(as_model(draft, SLOTS), half_forbidden), 8)
    engine = _engine(target, drafter, slots=SLOTS)
    whole = torch.zeros(8**STEPS, dtype=torch.long)
    assert_marginals(histograms(engine, params, seed0=60_000, whole=whole), exact)
    assert chi2_pvalue(whole, exact_whole) > ALPHA  # the whole generations too, not only each position
    if masked_q:  # every draft allowed: q is all on 'a', which the target takes with p('a')
        out = engine.generate(PROMPT, SamplingParams(temperature=1.0, seed=3), max_new_tokens=8, constraint=CONSTRAINT)
        assert out.stats.drafted > 0 and 5 not in out.token_ids


@pytest.mark.parametrize("during_pass", [False, True])
def test_one_hot_drafts_of_forbidden_tokens(pair, during_pass):
    """Random one-hot drafts, most of them forbidden somewhere: cut, and the rest verified, exactly; or, walked while
    the pass runs, verified whole (each forbidden token rejected, what follows never read), exactly."""
    from verispec.proposers import LookupDrafter

    target, _ = pair
    params = SamplingParams(temperature=0.8, top_k=5)
    exact = exact_marginals(masked_logits(hf_logits(target)), params)
    engine = _engine(target, LookupDrafter([RandomDrafts() for _ in range(SLOTS)]), k=3, during_pass=during_pass,
                     slots=SLOTS)
    assert_marginals(histograms(engine, params, seed0=70_000), exact)


def test_negative_control_q_reported_without_its_mask(pair, monkeypatch):
    """A draft drawn from its masked q but reporting q without the mask (half on 'x' again) is accepted at the wrong
    rate: the marginals must move, and the test must see it."""
    from verispec.proposers import draft_model

    target, draft = pair
    draw = draft_model.draft_token

    def unmasked_report(logits, params, presence, counts, position, rng):
        token, q = draw(logits, params, presence, counts, position, rng)
        return token, half_forbidden(logits).softmax(dim=-1)

    monkeypatch.setattr(draft_model, "draft_token", unmasked_report)
    params = SamplingParams(temperature=1.0)
    exact = exact_marginals(masked_logits(hf_logits(target)), params)
    drafter = DraftModel(MappedLogits(as_model(draft, SLOTS), half_forbidden), 8)
    counts = histograms(_engine(target, drafter, slots=SLOTS), params, seed0=85_000, n=2000)
    worst = max(total_variation(counts[p], exact[p]) for p in range(STEPS))
    assert worst > 0.08 and min(chi2_pvalue(counts[p], exact[p], 1000) for p in range(STEPS)) < 1e-6, worst


def test_negative_control_sampled_draft_cut_before_its_forbidden_token(pair, monkeypatch):
    """Cutting a sampled draft before its forbidden token (a one-hot draft's rule) draws that position from p
    instead of the residual norm(max(0, p - q)): the marginals must move, and the test must see it."""
    target, draft = pair
    walk = GrammarRow.walk
    monkeypatch.setattr(GrammarRow, "walk", lambda self, tokens, sampled: walk(self, tokens, False))
    params = SamplingParams(temperature=1.0)
    exact = exact_marginals(masked_logits(hf_logits(target)), params)
    drafter = UnmaskedDraft(MappedLogits(as_model(draft, SLOTS), half_forbidden), 8)
    counts = histograms(_engine(target, drafter, slots=SLOTS), params, seed0=80_000, n=2000)
    worst = max(total_variation(counts[p], exact[p]) for p in range(STEPS))
    assert worst > 0.08 and min(chi2_pvalue(counts[p], exact[p], 1000) for p in range(STEPS)) < 1e-6, worst


@pytest.mark.parametrize("drafter,during_pass", [("model", False), ("random", False), ("random", True)])
def test_greedy_equals_plain_under_the_grammar(pair, drafter, during_pass):
    from verispec.proposers import LookupDrafter

    target, draft = pair
    plain = _engine(target, None, k=0).generate(PROMPT, max_new_tokens=8, constraint=CONSTRAINT)
    made = DraftModel(HFModel(draft), 8) if drafter == "model" else LookupDrafter([RandomDrafts()])
    out = _engine(target, made, k=4, during_pass=during_pass).generate(PROMPT, max_new_tokens=8, constraint=CONSTRAINT)
    assert out.token_ids == plain.token_ids
    text = b"".join(TOKENS[t] for t in out.token_ids if t != EOS).decode()
    assert out.token_ids[-1] == EOS and out.finish_reason == "length" or len(out.token_ids) == 8
    import re

    assert re.fullmatch(PATTERN, text) or (len(out.token_ids) == 8 and re.fullmatch("[abc]*", text)), text


def test_forced_tokens_are_drafted_free(pair):
    """A grammar that fixes its answer drafts it whole (the drafter's own draft set aside): one round verifies every
    forced token and the end. Plain decoding (k = 0), the baseline, drafts nothing."""
    from verispec.proposers import LookupDrafter

    target, _ = pair
    choice = Constraint.choice(["ababab"])
    out = _engine(target, LookupDrafter([RandomDrafts()]), k=2).generate(PROMPT, max_new_tokens=6, constraint=choice)
    assert out.token_ids == [3, 3, 3, EOS] and out.stats.accepted == 3 and out.stats.target_forwards == 1
    plain = _engine(target, None, k=0).generate(PROMPT, max_new_tokens=6, constraint=choice)
    assert plain.token_ids == out.token_ids and plain.stats.accepted == 0 and plain.stats.target_forwards == 4


def test_bad_constraints_are_refused_with_a_reason(pair):
    target, _ = pair
    engine = _engine(target, None, k=0)
    for constraint, words in ((Constraint.regex("("), "invalid regex"),
                              (Constraint.grammar("start: nothing_defined"), "invalid grammar"),
                              (Constraint.json_schema({"type": "nonsense"}), "invalid json schema")):
        with pytest.raises(ValueError, match=words):
            engine.generate(PROMPT, max_new_tokens=2, constraint=constraint)
    with pytest.raises(ValueError, match="min_tokens"):
        engine.generate(PROMPT, SamplingParams(min_tokens=2), max_new_tokens=4, constraint=CONSTRAINT)
    plain = SpeculativeEngine(HFModel(target), None, k=0)
    with pytest.raises(ValueError, match="tokenizer"):
        plain.generate(PROMPT, max_new_tokens=2, constraint=CONSTRAINT)


def test_rows_of_different_grammars_share_a_batch_as_alone(pair):
    """Five rows, four grammars and none, greedy and seeded, in one batch's rounds: each row's tokens are its tokens
    alone."""
    from test_batch import run_all

    from verispec.backends.lean import LeanBatch, LeanNet
    from verispec.decoding.request import Request

    target, draft = pair

    def engine(slots):
        return SpeculativeEngine(LeanBatch(LeanNet(target), slots), DraftModel(LeanBatch(LeanNet(draft), slots), 8),
                                 k=3, grammars=GRAMMARS)

    constraints = [CONSTRAINT, Constraint.choice(["ababab", "bab"]), Constraint.regex("[ab]*c"),
                   Constraint.grammar('start: "ba" x "c"\nx: "a" | "b" x'), None]
    reqs = [dict(prompt_ids=PROMPT + [i], max_new_tokens=10, constraint=c,
                 params=SamplingParams(temperature=1.0, seed=i) if i % 2 else SamplingParams())
            for i, c in enumerate(constraints)]
    alone = [engine(1).generate(Request(**r)).token_ids for r in reqs]
    assert [r.token_ids for r in run_all(engine(5), reqs)] == alone
    assert alone[1][-1] == EOS and b"".join(TOKENS[t] for t in alone[1][:-1]) in (b"ababab", b"bab")  # any spelling
