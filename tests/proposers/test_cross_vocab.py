"""A draft model of another tokenizer (verispec.proposers.cross_vocab): the shared tokens, greedy identity, the
emitted distribution against exact enumeration (with negative controls), acceptance where the draft is the target
under other ids, batches, and the pipeline that builds such a pair."""

from __future__ import annotations

import math

import pytest
import torch
from stats_util import chi2_pvalue, generation_histograms
from test_engine import ALPHA, _exact_marginals
from tiny import (
    as_model,
    bpe_tokenizer,
    byte_tokenizer,
    permuted_byte_tokenizer,
    permuted_model,
    sentencepiece_tokenizer,
    tiny_qwen2,
)

from verispec.backends import HFModel
from verispec.backends.vocab import VocabBridge
from verispec.catalog.vocab import shared_tokens, token_bytes
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.proposers.cross_vocab import EXPLORE, CrossVocabDraft, WayChoice, text_pieces

CPU = torch.device("cpu")
# two small byte-level BPE vocabularies over the same text: 6 tokens in common, each with tokens the other lacks
TARGET_VOCAB = ["a", "b", "c", "d", "Ġ", "ab", "cd", "bc"]
TARGET_MERGES = [("a", "b"), ("c", "d"), ("b", "c")]
DRAFT_VOCAB = ["Ġ", "d", "c", "b", "a", "ab", "abc", "da", "Ġa"]
DRAFT_MERGES = [("a", "b"), ("ab", "c"), ("d", "a"), ("Ġ", "a")]


def cross_engine(target, draft, target_tok, draft_tok, k=3, eos=(), slots=1, sampled="auto") -> SpeculativeEngine:
    """An engine whose draft speaks `draft_tok` and the target `target_tok` (transformers models; slots > 1: both
    on the lean path); `sampled`: how sampled rows draft."""
    t, d = as_model(target, slots), as_model(draft, slots)
    bridge = VocabBridge(target_tok, draft_tok, t.vocab_size, d.vocab_size, CPU)
    return SpeculativeEngine(t, CrossVocabDraft(d, bridge, sampled), eos_token_ids=eos, k=k,
                             auto_policy=CostAwareK())


# -- the shared tokens -----------------------------------------------------------------------------------


def test_tokens_are_compared_by_bytes():
    target = bpe_tokenizer(TARGET_VOCAB, TARGET_MERGES, specials=("<eos>",))
    draft = bpe_tokenizer(DRAFT_VOCAB, DRAFT_MERGES, specials=("<eos>",))
    shared = shared_tokens(target.backend_tokenizer, draft.backend_tokenizer)
    assert shared.pairs == ((0, 4), (1, 3), (2, 2), (3, 1), (4, 0), (5, 5), (8, 9))  # a b c d Ġ ab <eos>
    assert (shared.target_size, shared.draft_size) == (9, 10)
    assert token_bytes(target.backend_tokenizer)[4] == b" " and token_bytes(draft.backend_tokenizer)[8] == b" a"
    sp = sentencepiece_tokenizer()
    table = token_bytes(sp.backend_tokenizer)
    assert table[sp.convert_tokens_to_ids("<0x41>")] == b"A" and table[sp.convert_tokens_to_ids("▁the")] == b" the"
    # a special token pairs only with a special token of the same text
    plain = bpe_tokenizer(TARGET_VOCAB + ["<eos>"], TARGET_MERGES)
    assert (8, 9) not in shared_tokens(plain.backend_tokenizer, draft.backend_tokenizer).pairs


def test_a_piece_pairs_before_a_byte_token():
    """A SentencePiece vocabulary holds "e" twice: as a piece and as the byte token <0x65>; the piece is what its
    model predicts, so it is the one paired (a byte token only where no piece holds the byte)."""
    byte, sp = byte_tokenizer(), sentencepiece_tokenizer()
    for target, draft, side in ((byte, sp, 1), (sp, byte, 0)):
        pairs = shared_tokens(target.backend_tokenizer, draft.backend_tokenizer).pairs
        pieces = {sp.convert_ids_to_tokens(pair[side]) for pair in pairs}
        assert {"e", "(", ","} <= pieces and "<0x65>" not in pieces and "<0x5A>" in pieces  # "Z": bytes only


def test_share_warning():
    byte = byte_tokenizer()
    few = bpe_tokenizer(["a", "b", "Ġ"] + [f"x{i}" for i in range(10)])
    assert shared_tokens(byte.backend_tokenizer, few.backend_tokenizer).warning() is not None
    subset = bpe_tokenizer(["a", "b", "Ġ", "x"])
    assert shared_tokens(byte.backend_tokenizer, subset.backend_tokenizer).warning() is None  # all the draft's tokens


def test_text_pieces_wait_for_a_whole_character():
    data = "né€".encode()
    assert text_pieces(data) == (["né€"], len(data))
    assert text_pieces(data[:-1]) == (["né"], 3) and text_pieces(data[:-2]) == (["né"], 3)
    assert text_pieces(b"a\xffb\xe2") == (["a", 0xFF, "b"], 3)  # a byte that is no UTF-8 stands alone


# -- greedy: token-identical to plain decoding -----------------------------------------------------------


@pytest.fixture(scope="module")
def text_models():
    """A target on the byte tokenizer and an unrelated draft on a SentencePiece one (its text does not round-trip
    byte for byte: it prepends a space)."""
    target_tok, draft_tok = byte_tokenizer(), sentencepiece_tokenizer()
    target = tiny_qwen2(31, vocab_size=len(target_tok), init=0.1)
    draft = tiny_qwen2(32, vocab_size=len(draft_tok) + 5, init=0.1)
    return target, draft, target_tok, draft_tok


@pytest.mark.parametrize("k", [1, 3, 6])
@pytest.mark.parametrize("prompt", ["the quick brown fox", "déf f(x): €"])
def test_greedy_identical_to_plain(text_models, k, prompt):
    target, draft, target_tok, draft_tok = text_models
    ids = target_tok.encode(prompt)
    plain = SpeculativeEngine(HFModel(target)).generate(ids, max_new_tokens=40)
    eng = cross_engine(target, draft, target_tok, draft_tok, k=k)
    for _ in range(2):  # the second generation keeps the draft tokens of the shared prompt
        out = eng.generate(ids, max_new_tokens=40)
        assert out.token_ids == plain.token_ids
    assert out.stats.draft_forwards > 0


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.9, seed=4)], ids=["greedy", "sampled"])
def test_draft_tokens_spell_the_committed_text(text_models, params):
    """After every generation the draft's tokens spell the target's text byte for byte: re-encoding running text
    adds no space (the SentencePiece draft prepends one to a text it sees as new: only the sequence's start gets
    it), drops nothing."""
    target, draft, target_tok, draft_tok = text_models
    eng = cross_engine(target, draft, target_tok, draft_tok, k=3)
    table = eng.drafter.bridge.draft_bytes
    for prompt in ["the quick brown fox", "hello world, this is", "the quick red fox"]:
        out = eng.generate(target_tok.encode(prompt), params, max_new_tokens=30)
        s = eng.drafter._slots[0]
        eng.drafter._sync(0, s.seq)
        assert bytes(s.text) == b"".join(eng.drafter.bridge.target_bytes[t] for t in s.seq.ids)
        spelled = b"".join(table[i] for i in s.ids[: s.checked])
        assert spelled == b" " + bytes(s.text[: s.spelled]), out.token_ids  # its one space: where a sequence opens
        assert len(s.text) - s.spelled < 4  # at most an incomplete character waits


def test_a_draft_past_its_context_stops_drafting(text_models):
    """A draft whose context is shorter than the generation drafts while its tokens fit, then leaves the rounds
    to the target: no error, greedy output as plain decoding's."""
    target, _, target_tok, draft_tok = text_models
    short = tiny_qwen2(33, vocab_size=len(draft_tok), init=0.1)
    short.config.max_position_embeddings = 24
    ids = target_tok.encode("the quick brown fox")
    plain = SpeculativeEngine(HFModel(target)).generate(ids, max_new_tokens=40)
    eng = cross_engine(target, short, target_tok, draft_tok, k=3)
    out = eng.generate(ids, max_new_tokens=40)
    assert out.token_ids == plain.token_ids and 0 < out.stats.draft_forwards
    assert eng.drafter.model.lengths[0] <= 24 and eng.drafter.source(0, eng.drafter._slots[0].seq) == "none"


def test_eos_and_stops_exact(text_models):
    target, draft, target_tok, draft_tok = text_models
    ids = target_tok.encode("hello world")
    plain = SpeculativeEngine(HFModel(target)).generate(ids, max_new_tokens=30)
    eos = plain.token_ids[7]
    want = SpeculativeEngine(HFModel(target), eos_token_ids=[eos]).generate(ids, max_new_tokens=30)
    out = cross_engine(target, draft, target_tok, draft_tok, k=4, eos=[eos]).generate(ids, max_new_tokens=30)
    assert out.token_ids == want.token_ids and out.token_ids[-1] == eos


# -- a draft that is the target under other ids: everything is accepted ------------------------------------


@pytest.fixture(scope="module")
def permuted_pair():
    target_tok = byte_tokenizer()
    draft_tok, perm = permuted_byte_tokenizer(5)
    target = tiny_qwen2(41, vocab_size=len(target_tok), init=0.1, scale=4.0)
    return target, permuted_model(target, perm), target_tok, draft_tok


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8, top_p=0.95, seed=3)],
                         ids=["greedy", "sampled"])
def test_same_model_under_other_ids_accepts_everything(permuted_pair, params):
    """Each draft token is the target's own choice only when the draft reads the committed text exactly (its
    tokens spell it) and q maps onto the right target ids: a shifted context or a wrong map drops acceptance.
    (Sampled rows draft over the shared tokens here: by text, a token is accepted with the target's probability
    of the argmax.)"""
    target, draft, target_tok, draft_tok = permuted_pair
    eng = cross_engine(target, draft, target_tok, draft_tok, k=4, sampled="shared")
    for prompt in ["def f(x):", "def f(x): return", "naïve café"]:
        out = eng.generate(target_tok.encode(prompt), params, max_new_tokens=48)
        assert out.stats.drafted >= 24 and out.stats.accepted >= 0.97 * out.stats.drafted, out.stats


def test_batched_rows_equal_their_solo_runs(permuted_pair):
    target, draft, target_tok, draft_tok = permuted_pair
    prompts = ["def f(x):", "hello", "naïve café", "for i in range(3):", "x = 1"]
    params = [SamplingParams(), SamplingParams(temperature=0.9, seed=1), SamplingParams(), SamplingParams(
        temperature=1.0, top_k=20, seed=2), SamplingParams(temperature=0.7, presence_penalty=0.5, seed=3)]
    solo = cross_engine(target, draft, target_tok, draft_tok, k=3, slots=2)
    want = [solo.generate(target_tok.encode(p), s, max_new_tokens=24).token_ids for p, s in zip(prompts, params)]
    batch = cross_engine(target, draft, target_tok, draft_tok, k=3, slots=3)
    rows = [batch.add(target_tok.encode(p), s, max_new_tokens=24) for p, s in zip(prompts[:3], params[:3])]
    waiting = list(zip(prompts[3:], params[3:]))
    while batch.active or waiting:
        batch.step()
        while waiting and batch.free_slots:
            p, s = waiting.pop(0)
            rows.append(batch.add(target_tok.encode(p), s, max_new_tokens=24))
    assert [r.result.token_ids for r in rows] == want


# -- sampled: the emitted distribution is the target's ------------------------------------------------------


@pytest.fixture(scope="module")
def small_pair():
    target_tok = bpe_tokenizer(TARGET_VOCAB, TARGET_MERGES)
    draft_tok = bpe_tokenizer(DRAFT_VOCAB, DRAFT_MERGES)
    target = tiny_qwen2(51, vocab_size=8, hidden=32, init=0.5)
    draft = tiny_qwen2(52, vocab_size=9, hidden=32, init=0.5)  # the target's layers; its tokens where they share
    state = {name: w for name, w in target.state_dict().items() if "embed_tokens" not in name and "lm_head" not in name}
    draft.load_state_dict(state, strict=False)
    pairs = torch.tensor(shared_tokens(target_tok.backend_tokenizer, draft_tok.backend_tokenizer).pairs)
    with torch.no_grad():
        for d, t in ((draft.model.embed_tokens.weight, target.model.embed_tokens.weight),
                     (draft.lm_head.weight, target.lm_head.weight)):
            d[pairs[:, 1]] = t[pairs[:, 0]]
    return target, draft, target_tok, draft_tok


PROMPT = [0, 1, 4]  # "ab " in the target's tokens


def _exact(model, params: SamplingParams, steps: int) -> list[torch.Tensor]:
    """Each of the first `steps` tokens' marginal distribution under plain sampling, by enumeration."""
    seqs, weights, marginals = torch.tensor([PROMPT]), torch.ones(1, dtype=torch.float64), []
    for _ in range(steps):
        with torch.no_grad():
            probs = probs_from_logits(model(input_ids=seqs).logits[:, -1], params).double()  # [S, 8]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(0))
        seqs = torch.cat([seqs.repeat_interleave(8, 0), torch.arange(8).repeat(len(seqs))[:, None]], 1)
        weights = joint.reshape(-1)
    return marginals


def _histograms(small_pair, params: SamplingParams, n: int, steps: int, sampled: str = "shared"
                ) -> tuple[torch.Tensor, int]:
    target, draft, target_tok, draft_tok = small_pair
    eng = cross_engine(target, draft, target_tok, draft_tok, k=2, sampled=sampled, slots=8)
    counts, _, accepted = generation_histograms(eng, PROMPT, params, n, steps, 8)
    return counts, accepted


@pytest.mark.parametrize("params, sampled", [(SamplingParams(temperature=1.0), "shared"),
                                             (SamplingParams(temperature=1.0), "auto"),
                                             (SamplingParams(temperature=0.8, top_k=5), "shared"),
                                             (SamplingParams(temperature=0.8, top_k=5), "text")],
                         ids=["temperature-shared", "temperature-auto", "top_k-shared", "top_k-text"])
def test_marginals_match_target(small_pair, params, sampled):
    """Tokens 1-4 of speculative generations with a draft of another vocabulary (k = 2; the first token from the
    prefill's pass, a draft model drafting from the second round) follow the target's exact marginals, whichever
    way sampled rows draft (auto: a request's first drafting round over the shared tokens, its next by text).
    V = 8, N = 3000; false-failure probability 4 x ALPHA. The draft's tokens are accepted often enough for the test
    to see them."""
    exact = _exact(small_pair[0], params, 4)
    counts, accepted = _histograms(small_pair, params, 3000, 4, sampled)
    assert accepted > (1500 if sampled == "shared" else 1000)  # by text, the draft's argmax: accepted less here
    for pos in range(4):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_penalised_marginals_match_target(small_pair):
    """The same with presence and frequency penalties and min_tokens (the draft's q counts the target's tokens)."""
    params = SamplingParams(temperature=1.0, presence_penalty=1.2, frequency_penalty=0.8, min_tokens=2,
                            stop_ids=(0, 5))
    exact = _exact_marginals(small_pair[0], PROMPT, params, 4)
    counts, _ = _histograms(small_pair, params, 1500, 4, "auto")
    for pos in range(4):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_negative_control_q_not_restricted(small_pair, monkeypatch):
    """The same test fails when the draft samples from its whole vocabulary's mass (q not renormalised over the
    shared tokens) but reports q restricted: the rejection sampler is then told the wrong q."""
    import verispec.proposers.cross_vocab as module

    real = module.draft_token

    def wrong_q(logits, params, presence, counts, position, rng):
        token, q = real(logits, params, presence, counts, position, rng)
        flat = torch.where(q > 0, torch.ones_like(q), torch.zeros_like(q))
        return token, flat / flat.sum(-1, keepdim=True)  # claims q uniform over the shared tokens

    monkeypatch.setattr(module, "draft_token", wrong_q)
    params = SamplingParams(temperature=1.0)
    exact = _exact(small_pair[0], params, 3)  # token 1 from the prefill, token 2 drafted
    counts, _ = _histograms(small_pair, params, 1500, 3)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(3)) < ALPHA


# -- how sampled rows draft --------------------------------------------------------------------------------


def test_way_choice_follows_acceptance():
    """'auto' drafts the way accepted at the higher rate, the other in about EXPLORE * sqrt(rounds) of the rounds,
    and turns when the rates do; a fixed way never changes; an unknown one is refused."""
    assert {WayChoice("text").pick() for _ in range(20)} == {"text"}
    assert {WayChoice("shared").pick() for _ in range(20)} == {"shared"}
    with pytest.raises(ValueError, match="unknown way"):
        WayChoice("argmax")
    ways = WayChoice()
    for _ in range(100):
        way = ways.pick()
        ways.record(way, 4, 3 if way == "text" else 0)
    assert EXPLORE * math.sqrt(100) <= ways.count["shared"] <= EXPLORE * math.sqrt(100) + 1, ways.count
    for _ in range(10):
        ways.record("shared", 4, 4)
    picks = [ways.pick() for _ in range(20)]
    assert picks == ["shared"] * 20 and ways.rate("shared") > ways.rate("text")  # text has its share already


def test_a_way_that_drafts_nothing_loses():
    """Rounds by text that draft nothing (k draft tokens inside one character) count as rejections, so 'auto'
    leaves them for the shared tokens even when those are accepted rarely."""
    ways = WayChoice()
    for _ in range(60):
        way = ways.pick()
        drafted, accepted = (0, 0) if way == "text" else (4, 1)
        ways.record(way, drafted, accepted)
    assert ways.count["shared"] > 3 * ways.count["text"], ways.count


def test_auto_drafts_the_way_accepted_more(permuted_pair):
    """A draft that is the target under other ids: its shared-token q is the target's p (every draft accepted), its
    argmax only with p's probability of it, so a sampled request's rounds go mostly over the shared tokens."""
    target, draft, target_tok, draft_tok = permuted_pair
    eng = cross_engine(target, draft, target_tok, draft_tok, k=4)
    out = eng.generate(target_tok.encode("def f(x):"), SamplingParams(temperature=1.0, seed=5), max_new_tokens=96)
    ways = eng.drafter._slots[0].ways
    assert ways.rate("shared") > ways.rate("text"), (ways.accepted, ways.rejected)
    assert ways.count["shared"] > 2 * ways.count["text"], ways.count
    assert sum(ways.count.values()) == out.stats.rounds  # every round drafted, and was counted
