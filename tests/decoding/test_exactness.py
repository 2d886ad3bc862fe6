"""Whole generations on tiny models: the speculative loop's per-position marginals equal plain decoding's
(computed exactly by enumeration), for every sampling option and draft kind; stops, EOS and length limits
inside an accepted block give plain decoding's output for any k.

Resolution: N = 6000 generations, V = 8, 3 positions. Under the null the empirical TV of a position is
~0.013 (sd ~0.003), so `TV < 0.03` fails with probability < 1e-6 by chance, while a defect that moves a
position's distribution by TV >= 0.03 fails it about half the time and by 0.04 almost always; the
chi-square test (ALPHA = 1e-4 per position) catches most such defects too. False-failure probability
per test: < 3 x (1e-4 + 1e-6)."""

from __future__ import annotations

import copy
import string

import pytest
import torch
from stats_util import chi2_pvalue, generation_histograms, total_variation
from tiny import as_model, byte_tokenizer, make_engine, perturbed, tiny_qwen2

from verispec.backends import HFModel
from verispec.backends.lean import LeanBatch, LeanNet
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.pipeline.text import TextAssembler
from verispec.proposers import DraftModel, HybridDrafter, LookupDrafter, NgramProposer

ALPHA = 1e-4
N = 6000
STEPS = 3
PROMPT = [3, 1, 2]
TV_RESOLUTION = 0.03
SLOTS = 8  # generations decoded at once: each row follows from its own seed, as alone (tests/decoding/test_batch.py)


class MappedLogits:
    """A Model whose logits pass through `fn` (rounding them to a grid, masking tokens): a target or draft
    with properties a test needs, through the engine's real Model interface."""

    def __init__(self, model: HFModel, fn) -> None:
        self.model, self.fn = model, fn
        self.device, self.vocab_size, self.max_length = model.device, model.vocab_size, model.max_length
        self.slots = model.slots

    @property
    def lengths(self) -> list[int]:
        return self.model.lengths

    def forward_rows(self, slots, feeds, last_only=False, logits_for=None):
        return [self.fn(logits) for logits in self.model.forward_rows(slots, feeds, last_only, logits_for)]

    def rollback(self, slot, length):
        self.model.rollback(slot, length)

    def swap(self, a, b):
        self.model.swap(a, b)

    def reset(self, slot=None):
        self.model.reset(slot)


def rounded(logits: torch.Tensor, grid: float = 0.5) -> torch.Tensor:
    """Logits on a grid of 0.5: ties everywhere, as in bf16 logits."""
    return (logits / grid).round() * grid


def exact_marginals(logits_fn, prompt: list[int], params: SamplingParams, steps: int, vocab: int) -> list[torch.Tensor]:
    """Marginal distribution of each of the first `steps` tokens under plain sampling, by enumerating every
    sequence with its probability. logits_fn(seqs [S, L]) -> last logits [S, V]. Penalties see each
    sequence's own tokens (prompt and generated so far), as plain decoding does."""
    seqs = torch.tensor([prompt])  # [S, L]
    weights = torch.ones(1, dtype=torch.float64)
    marginals = []
    for _ in range(steps):
        presence = torch.zeros(len(seqs), vocab, dtype=torch.bool).scatter_(1, seqs, True)  # [S, V]
        probs = probs_from_logits(logits_fn(seqs), params, presence if params.penalised else None).double()
        joint = weights[:, None] * probs  # [S, V]
        marginals.append(joint.sum(0))
        seqs = torch.cat([seqs.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(len(seqs))[:, None]], 1)
        weights = joint.reshape(-1)
    return marginals


def hf_logits(model, fn=lambda logits: logits):
    def logits_fn(seqs):
        with torch.no_grad():
            return fn(model(input_ids=seqs).logits[:, -1].float())

    return logits_fn


def histograms(engine: SpeculativeEngine, params: SamplingParams, n: int = N, seed0: int = 0) -> torch.Tensor:
    """counts [STEPS, V] of the tokens emitted at each position over n seeded generations (SLOTS at a time)."""
    return generation_histograms(engine, PROMPT, params, n, STEPS, engine.target.vocab_size, seed0)[0]


def assert_marginals(counts: torch.Tensor, exact: list[torch.Tensor]) -> None:
    for pos in range(STEPS):
        assert int(counts[pos].sum()) == N, pos  # every generation reached every position
        p_value, tv = chi2_pvalue(counts[pos], exact[pos]), total_variation(counts[pos], exact[pos])
        assert p_value > ALPHA and tv < TV_RESOLUTION, (pos, p_value, tv)


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


def _engine(target, drafter, k=2):
    return SpeculativeEngine(target, drafter, k=k, auto_policy=CostAwareK())


# -- the loop's marginals under each sampling option and draft kind ---------------------------------------


def test_top_p_with_tied_logits(pair):
    """Target and draft logits on a grid of 0.5, so the nucleus boundary falls on ties; top-p 0.6 keeps
    2-5 of 8 tokens, and a verify row (k + 1 rows at once) must cut exactly as plain decoding's one row."""
    target, draft = pair
    params = SamplingParams(temperature=1.0, top_p=0.6)
    engine = _engine(MappedLogits(as_model(target, SLOTS), rounded),
                     DraftModel(MappedLogits(as_model(draft, SLOTS), rounded), 8))
    exact = exact_marginals(hf_logits(target, rounded), PROMPT, params, STEPS, 8)
    assert all(int((m > 0).sum()) >= 2 for m in exact)  # not a point mass: the nucleus matters
    assert_marginals(histograms(engine, params), exact)


def test_min_p(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.9, min_p=0.15)
    exact = exact_marginals(hf_logits(target), PROMPT, params, STEPS, 8)
    assert_marginals(histograms(make_engine(target, draft, k=2, slots=SLOTS), params, seed0=10_000), exact)


def test_logit_bias(pair):
    """OpenAI's logit_bias on the target's p and the draft's q alike (q's changes only acceptance)."""
    target, draft = pair
    params = SamplingParams(temperature=1.0, logit_bias={2: 2.5, 5: -3.0, 6: 1.0})
    exact = exact_marginals(hf_logits(target), PROMPT, params, STEPS, 8)
    assert_marginals(histograms(make_engine(target, draft, k=2, slots=SLOTS), params, seed0=90_000), exact)


def test_repetition_penalty_under_sampling(pair):
    """Each verify row sees the context plus the drafts before it; plain decoding sees what it generated."""
    target, draft = pair
    params = SamplingParams(temperature=1.0, repetition_penalty=1.8)
    exact = exact_marginals(hf_logits(target), PROMPT, params, STEPS, 8)
    assert_marginals(histograms(make_engine(target, draft, k=2, slots=SLOTS), params, seed0=20_000), exact)


def test_hybrid_drafter_under_sampling(pair):
    """n-gram drafts (q one-hot) when the context repeats, sampled model drafts otherwise, in one loop."""
    target, draft = pair
    params = SamplingParams(temperature=1.0)
    drafter = HybridDrafter(LookupDrafter([NgramProposer(max_ngram=2, min_ngram=1, min_confident=1)
                                           for _ in range(SLOTS)]), DraftModel(as_model(draft, SLOTS), 8))
    engine = _engine(as_model(target, SLOTS), drafter)
    exact = exact_marginals(hf_logits(target), PROMPT, params, STEPS, 8)
    counts = histograms(engine, params, seed0=30_000)
    assert_marginals(counts, exact)


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantised_draft(pair, mode):
    from verispec.backends.quant import quantize_model

    target, draft = pair
    params = SamplingParams(temperature=1.0)
    exact = exact_marginals(hf_logits(target), PROMPT, params, STEPS, 8)
    lean = LeanBatch(LeanNet(copy.deepcopy(draft)), SLOTS)
    quantize_model(lean.net, mode)  # as verispec.assembly quantises a lean draft: its fused layers packed
    engine = make_engine(target, lean, k=2, slots=SLOTS)
    assert_marginals(histograms(engine, params, seed0=40_000), exact)


def test_reduced_vocabulary_draft(pair):
    """The draft scores only tokens {0, 2, 3, 6} (q = 0 for the other four): those are reached only
    through the recovered distribution, and still at their exact rates."""
    from verispec.backends.vocab import restrict_head

    target, draft = pair
    params = SamplingParams(temperature=1.0)
    exact = exact_marginals(hf_logits(target), PROMPT, params, STEPS, 8)
    assert min(exact[pos][[1, 4, 5, 7]].sum() for pos in range(STEPS)) > 0.2  # the test reaches those tokens
    reduced = restrict_head(copy.deepcopy(draft), torch.tensor([0, 2, 3, 6]))
    assert_marginals(histograms(make_engine(target, reduced, k=2, slots=SLOTS), params, seed0=50_000), exact)


# -- stops, EOS and the length limit inside an accepted block -------------------------------------------


@pytest.fixture(scope="module")
def text_pair():
    """A byte-vocabulary model that writes lowercase letters and spaces only (other logits -inf: text with
    no partial UTF-8 characters), and the same model as its draft: every round accepts its whole block, so
    stops, EOS and max_new_tokens land inside accepted blocks."""
    tok = byte_tokenizer()
    allowed = torch.tensor([tok.decode([i]) in string.ascii_lowercase + " " for i in range(264)])
    return tiny_qwen2(31, vocab_size=264, init=0.1), allowed, tok


def _generate(text_pair, k, stops=(), eos=(), max_new=40):
    target, allowed, tok = text_pair
    letters = lambda logits: logits.masked_fill(~allowed, float("-inf"))
    drafter = DraftModel(MappedLogits(HFModel(copy.deepcopy(target)), letters), 264) if k else None
    engine = SpeculativeEngine(MappedLogits(HFModel(target), letters), drafter, eos_token_ids=eos,
                               k=k)
    asm = TextAssembler(tok, stop=stops)
    out = engine.generate(tok("fn ").input_ids, max_new_tokens=max_new, stop=asm.stop_index if stops else None)
    asm.push(out.token_ids)
    return out, asm.text


@pytest.mark.parametrize("k", [1, 4, 8])
def test_overlapping_and_multi_token_stops_match_plain(text_pair, k):
    _, text = _generate(text_pair, 0)
    assert len(text) >= 12 and text.isascii()
    for stops in (
        [text[5:9], text[7]],  # a 4-token stop and a 1-token stop inside it: the short one completes first
        [text[7], text[5:9]],
        [text[3:10], text[6:11]],  # overlapping: the first one ends first
        [text[6:11], text[3:10]],
        [text[9:11]],
    ):
        ref, ref_text = _generate(text_pair, 0, stops)
        out, out_text = _generate(text_pair, k, stops)
        assert out.token_ids == ref.token_ids and out_text == ref_text and out.finish_reason == "stop", stops
        assert out.stats.accepted <= len(out.token_ids)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_eos_inside_an_accepted_block(text_pair, k):
    """EOS is the 3rd token plain decoding emits: speculation stops there too, and its stats count only the
    drafts it emitted (the rest of the block was dropped, and none of it was rejected)."""
    plain, _ = _generate(text_pair, 0)
    eos = plain.token_ids[2]
    assert eos not in plain.token_ids[:2]
    ref, _ = _generate(text_pair, 0, eos=[eos])
    out, _ = _generate(text_pair, k, eos=[eos])
    assert out.token_ids == ref.token_ids == plain.token_ids[:3] and out.finish_reason == "stop"
    stats = out.stats
    assert sum(stats.accepted_per_position) == stats.accepted and sum(stats.drafted_per_position) == stats.drafted
    assert stats.acceptance_rate == 1.0  # the draft is the target: every emitted draft was accepted
    # round 1 (the prefill's pass: a draft model drafts no first round) emits the first token; k = 1: round 2
    # emits d1 and the target's token, EOS; k >= 2: round 2 emits d1 d2 = EOS, the rest of its block dropped
    assert stats.accepted == (1 if k == 1 else 2)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("max_new", [1, 2, 5, 11])
def test_max_new_tokens_inside_a_block(text_pair, k, max_new):
    ref, _ = _generate(text_pair, 0, max_new=max_new)
    out, _ = _generate(text_pair, k, max_new=max_new)
    assert out.token_ids == ref.token_ids and len(out.token_ids) == max_new and out.finish_reason == "length"
    assert out.stats.accepted <= max_new - 1  # a round's own token always follows its accepted drafts
