"""The speculative loop on tiny real transformers models: greedy identity, rollback, seeds, distribution."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from stats_util import chi2_pvalue, generation_histograms, seeded_results
from tiny import lone_rounds, make_engine, perturbed, tiny_qwen2

from verispec import SamplingParams
from verispec.backends import HFModel, Sequence
from verispec.core.draft import Draft
from verispec.decoding.request import Request

ALPHA = 1e-4


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(1)
    return target, perturbed(target, seed=2, noise=0.05)


PROMPTS = {"one": [7], "short": [3, 1, 4, 1, 5], "long": list(range(2, 60))}


@pytest.mark.parametrize("k", [1, 3, 8])
@pytest.mark.parametrize("prompt", list(PROMPTS))
@pytest.mark.parametrize("draft_seed", [2, 5])
def test_greedy_identical_to_plain(pair, k, prompt, draft_seed):
    target, _ = pair
    draft = perturbed(target, seed=draft_seed, noise=0.05 if draft_seed == 2 else 0.3)
    ids = PROMPTS[prompt]
    plain = make_engine(target).generate(ids, max_new_tokens=48)
    spec = make_engine(target, draft, k=k).generate(ids, max_new_tokens=48)
    assert spec.token_ids == plain.token_ids
    assert spec.stats.new_tokens == 48 and spec.finish_reason == "length"
    assert spec.stats.target_forwards < 48 or spec.stats.acceptance_rate == 0
    assert spec.stats.drafted > 0


@pytest.mark.parametrize("max_new", [1, 2, 3, 9])
def test_max_new_tokens_edges(pair, max_new):
    target, draft = pair
    plain = make_engine(target).generate([1, 2, 3], max_new_tokens=max_new)
    spec = make_engine(target, draft, k=8).generate([1, 2, 3], max_new_tokens=max_new)
    assert spec.token_ids == plain.token_ids and len(spec.token_ids) == max_new


@pytest.mark.parametrize("k", [1, 4])
def test_eos_stops_exactly(pair, k):
    target, draft = pair
    plain = make_engine(target).generate([9, 8, 7], max_new_tokens=40).token_ids
    for pos in (0, 5, 17):  # make the token at `pos` an EOS: generation must end right there
        eos = plain[pos]
        first = plain.index(eos)
        spec = make_engine(target, draft, k=k, eos=[eos]).generate([9, 8, 7], max_new_tokens=40)
        assert spec.token_ids == plain[: first + 1]
        assert spec.finish_reason == "stop"


def test_draft_equals_target_accepts_everything(pair):
    target, _ = pair
    spec = make_engine(target, target, k=5).generate([4, 4, 2], max_new_tokens=40)
    assert spec.stats.acceptance_rate == 1.0
    assert spec.stats.mean_accepted_length == 6.0 or spec.stats.rounds * 6 > 40


def test_repetition_penalty_greedy_identical(pair):
    target, draft = pair
    params = SamplingParams(repetition_penalty=1.5)
    plain = make_engine(target).generate([1, 2, 3], params, max_new_tokens=40)
    spec = make_engine(target, draft, k=4).generate([1, 2, 3], params, max_new_tokens=40)
    assert spec.token_ids == plain.token_ids
    unpenalised = make_engine(target).generate([1, 2, 3], max_new_tokens=40)
    assert plain.token_ids != unpenalised.token_ids  # the penalty really acted


class _Counting:
    """A one-slot Model that records the number of tokens of every forward call (slots, lengths, rollback, move
    and reset are the wrapped model's)."""

    def __init__(self, model) -> None:
        self.model, self.calls = model, []

    def __getattr__(self, name):
        return getattr(self.model, name)

    def forward_rows(self, slots, feeds, last_only=False, logits_for=None):
        assert slots == [0]
        self.calls.append(feeds[0].numel())
        return self.model.forward_rows(slots, feeds, last_only, logits_for)


@pytest.mark.parametrize("drafter", ["none", "model", "silent"])
def test_one_target_pass_per_round_prefill_included(pair, drafter):
    """The first round's one pass feeds the whole prompt (and that round's drafts, if any), and the logits at the
    prompt's last position give the first token, as plain decoders do: plain decoding of n tokens is n target
    passes (the prompt, then n - 1 single tokens), never n + 1; a first round with k drafts is ONE pass over
    the prompt + k drafts; k = auto with a drafter that never drafts is plain after its cost-learning rounds."""
    from verispec.proposers import NgramProposer

    class Silent(NgramProposer):  # an n-gram lookup that never finds a match
        def propose(self, seq, k):
            return Draft(seq.device_ids.new_empty(0), None)

    target, draft = pair
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = make_engine(target).generate(prompt, max_new_tokens=12).token_ids
    engine = make_engine(target, draft if drafter == "model" else None, k=3,
                         drafter=Silent() if drafter == "silent" else "model")
    if drafter == "silent":
        engine.k = "auto"
    engine.target = counting = _Counting(engine.target)
    result = engine.generate(prompt, max_new_tokens=12)
    assert result.token_ids == plain
    assert result.stats.target_forwards == len(counting.calls)
    if drafter == "model":  # the draft has yet to read the prompt: the first round is the prompt's pass alone
        assert counting.calls[0] == len(prompt)
        assert counting.calls[1] == 1 + 3  # then the last committed token and the drafts
        assert result.stats.drafted > 0
    elif drafter == "silent":  # k = auto: the prompt's pass, a plain pass (t_verify(0)), then one free guess
        assert counting.calls[:3] == [len(prompt), 1, 2] and set(counting.calls[3:]) == {1}  # (a 2-token pass)
        assert result.stats.drafted == 1 and result.stats.draft_forwards == 0
    else:
        assert counting.calls == [len(prompt)] + [1] * 11
        assert result.stats.drafted == 0


def test_first_token_does_not_wait_for_the_draft(pair):
    """A draft model drafts no first round, even when its cache already holds the prompt: the first token comes
    from the target's prefill alone, and the draft catches up and drafts from the second round. A free drafter
    drafts in the first round, in the prefill's pass."""
    target, _ = pair
    engine = make_engine(target, target, k=4)  # the target as its own draft: every draft is accepted
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for _ in range(2):  # the second time the draft's cache holds the prompt
        chunks = list(lone_rounds(engine, prompt, max_new_tokens=16)[0])
        assert [len(c) for c in chunks[:2]] == [1, 5] and chunks[0].accepted == 0
    lookup = make_engine(target, None, k=3, drafter="ngram")
    lookup.target = counting = _Counting(lookup.target)
    lookup.generate([5, 6, 7, 8, 5, 6, 7], max_new_tokens=8)
    assert counting.calls[0] == 7 + 3  # the prompt and the n-gram's three drafts (8 5 6), in one pass


def test_prefix_reuse_still_feeds_the_last_token(pair):
    """A prompt whose every token is cached already (a repeat) still feeds its last token: its logits are
    the first round's."""
    target, _ = pair
    engine = make_engine(target)
    first = engine.generate([2, 7, 1, 8, 2, 8], max_new_tokens=6).token_ids
    engine.target = counting = _Counting(engine.target)
    again = engine.generate([2, 7, 1, 8, 2, 8], max_new_tokens=6).token_ids
    assert again == first and counting.calls[0] == 1
    longer = engine.generate([2, 7, 1, 8, 2, 8] + first[:3], max_new_tokens=3).token_ids
    assert longer == first[3:6] and counting.calls[6] == 1


def test_rollback_then_decode_equals_fresh(pair):
    target, _ = pair
    seq = torch.tensor([5, 6, 7, 8, 9, 10, 11, 12])
    fresh = Sequence(HFModel(target)).forward(seq)
    m = Sequence(HFModel(target))
    m.forward(seq[:5])
    m.forward(torch.tensor([60, 61, 62]))  # rejected drafts
    m.rollback(5)
    assert m.length == 5
    again = m.forward(seq[5:])
    torch.testing.assert_close(again, fresh[5:], rtol=1e-5, atol=1e-5)


def test_seeded_runs_reproduce(pair):
    target, draft = pair
    params = SamplingParams(temperature=1.0, top_p=0.95, seed=1234)
    a = make_engine(target, draft, k=3).generate([1, 2], params, max_new_tokens=30)
    b = make_engine(target, draft, k=3).generate([1, 2], params, max_new_tokens=30)
    c = make_engine(target, draft, k=3).generate([1, 2], SamplingParams(temperature=1.0, top_p=0.95, seed=99),
                                                 max_new_tokens=30)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids
    state = torch.random.get_rng_state()
    make_engine(target, draft, k=3).generate([1, 2], params, max_new_tokens=5)
    assert torch.equal(state, torch.random.get_rng_state())  # the global RNG is untouched


def test_prefix_reuse_across_generations(pair):
    """A second generation whose prompt extends the first reuses both caches and still equals a fresh run."""
    target, draft = pair
    eng = make_engine(target, draft, k=3)
    first = eng.generate([1, 2, 3], max_new_tokens=10)
    prompt2 = [1, 2, 3] + first.token_ids + [40, 41]
    reused = eng.generate(prompt2, max_new_tokens=20)
    fresh = make_engine(target).generate(prompt2, max_new_tokens=20)
    assert reused.token_ids == fresh.token_ids
    other = eng.generate([50, 51], max_new_tokens=10)  # a prompt with no common prefix
    assert other.token_ids == make_engine(target).generate([50, 51], max_new_tokens=10).token_ids


def test_stop_callback_truncates(pair):
    target, draft = pair
    plain = make_engine(target).generate([2, 3], max_new_tokens=30).token_ids

    def stop_after_7(generated):
        return 7 if len(generated) >= 7 else None

    spec = make_engine(target, draft, k=8).generate([2, 3], max_new_tokens=30, stop=stop_after_7)
    assert spec.token_ids == plain[:7] and spec.finish_reason == "stop"


def test_stream_chunks_concatenate_to_result(pair):
    target, draft = pair
    rounds, result = lone_rounds(make_engine(target, draft, k=4), [1, 2, 3], max_new_tokens=25)
    chunks = list(rounds)
    assert [t for chunk in chunks for t in chunk] == result.token_ids
    assert all(1 <= len(c) <= 5 for c in chunks)


@pytest.mark.parametrize("stop_at", [None, 7])
def test_stream_chunks_carry_provenance(pair, stop_at):
    """Each chunk says how many of its tokens were drafted and accepted; the rest, one per round unless a stop
    cut the round, the target produced. Over a stream they add up to the accepted count and the tokens."""
    target, draft = pair
    stop = (lambda generated: stop_at if len(generated) >= stop_at else None) if stop_at else None
    rounds, result = lone_rounds(make_engine(target, draft, k=4), [1, 2, 3], max_new_tokens=25, stop=stop)
    chunks = list(rounds)
    assert all(0 <= c.accepted <= len(c) and c.target == len(c) - c.accepted for c in chunks)
    assert all(c.target == 1 for c in chunks[:-1]) and chunks[-1].target <= 1
    assert sum(c.accepted for c in chunks) == result.stats.accepted
    assert sum(c.accepted + c.target for c in chunks) == len(result.token_ids)
    assert sum(c.accepted for c in chunks) > 0  # the perturbed draft is accepted often


def test_draft_with_wider_logits_is_exact(pair):
    """A draft whose logit width differs from the target's (padded vocabularies) stays lossless."""
    target, _ = pair
    small = tiny_qwen2(3, vocab_size=80)
    plain = make_engine(target).generate([1, 2, 3], max_new_tokens=20)
    spec = make_engine(target, small, k=3).generate([1, 2, 3], max_new_tokens=20)
    assert spec.token_ids == plain.token_ids
    sampled = make_engine(target, small, k=3).generate([1, 2, 3], SamplingParams(temperature=1.0, seed=0),
                                                       max_new_tokens=20)
    assert len(sampled.token_ids) == 20


def test_align_vocab():
    from verispec.proposers.draft_model import align_vocab

    logits = torch.tensor([[1.0, 2.0, 3.0]])
    assert align_vocab(logits, 2).tolist() == [[1.0, 2.0]]
    padded = align_vocab(logits, 5)
    assert padded[0, :3].tolist() == [1.0, 2.0, 3.0] and torch.isinf(padded[0, 3:]).all()
    assert padded.softmax(-1)[0, 3:].sum() == 0  # q = 0 where the draft has no logit


def test_bad_arguments(pair):
    target, draft = pair
    eng = make_engine(target, draft)
    with pytest.raises(ValueError, match="empty"):
        eng.generate([], max_new_tokens=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.generate([1], max_new_tokens=0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="context"):
        eng.generate([1] * 4100, max_new_tokens=3)
    with pytest.raises(ValueError, match="out of range"):
        eng.generate([1, 64], max_new_tokens=3)
    with pytest.raises(ValueError, match="lookup text"):
        eng.generate(Request(prompt_ids=(1, 2), max_new_tokens=3, lookup_texts=((3, 64),)))


# -- the emitted distribution through the whole loop ----------------------------------------------


def _exact_marginals(model, prompt: list[int], params: SamplingParams, steps: int) -> list[torch.Tensor]:
    """Marginal distribution of each of the first `steps` tokens under plain sampling, by enumeration (every
    sequence of a step a row of one forward); penalties see each sequence's own presence and counts, min_tokens
    masks the stop ids at the first positions."""
    from verispec.core.sampling import probs_from_logits

    V = model.config.vocab_size
    seqs = torch.tensor([prompt])  # [S, L]
    weights = torch.ones(1, dtype=torch.float64)
    marginals = []
    unmasked = replace(params, min_tokens=0)  # the rows are sequences, all at one position: masked here, not by row
    for step in range(steps):
        with torch.no_grad():
            logits = model(input_ids=seqs).logits[:, -1].float()  # [S, V]
        if params.masks_stops(step):
            logits = logits.index_fill(1, torch.tensor(params.stop_ids), float("-inf"))
        presence = counts = None
        if params.penalised or params.counted:
            generated = seqs[:, len(prompt):]
            presence = torch.zeros(len(seqs), V, dtype=torch.bool).scatter_(1, seqs, True)
            counts = torch.zeros(len(seqs), V, dtype=torch.int32).scatter_add_(
                1, generated, torch.ones_like(generated, dtype=torch.int32))
        probs = probs_from_logits(logits, unmasked, presence, counts).double()  # [S, V]
        joint = weights[:, None] * probs
        marginals.append(joint.sum(0))
        seqs = torch.cat([seqs.repeat_interleave(V, 0), torch.arange(V).repeat(len(seqs))[:, None]], 1)
        weights = joint.reshape(-1)
    return marginals


def _engine_histograms(target, draft, params, n, k, steps, seed0):
    """Histograms of the first `steps` tokens of n seeded generations from [3, 1, 2], eight at a time."""
    eng = make_engine(target, draft, k=k, slots=8)
    return generation_histograms(eng, [3, 1, 2], params, n, steps, target.config.vocab_size, seed0)[0]


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5)],
                         ids=["temperature", "top_k"])
def test_loop_marginals_match_target(small_vocab_pair, params):
    """Tokens 1-4 of speculative generations (k = 2: the first round's token from the prefill, then two draft
    positions, then bonus or next round) follow the target's exact marginals. V = 8, N = 3000 generations:
    detects TV >= ~0.05 with high power; the per-position TV ~ 0.01 resolution lives in test_verify.
    False-failure probability: 4 positions x ALPHA = 4e-4."""
    target, draft = small_vocab_pair
    steps = 4
    exact = _exact_marginals(target, [3, 1, 2], params, steps)
    counts = _engine_histograms(target, draft, params, n=3000, k=2, steps=steps, seed0=0)
    for pos in range(steps):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_loop_marginals_with_cost_learning_rounds(small_vocab_pair):
    """k = auto from a fresh policy every generation: two plain rounds (the first one's pass feeds the prompt),
    a round that verifies a free guess (a filler round, q one-hot), the draft's timed step (reported as free
    here, so that it drafts), then model drafts. Tokens 1-5 follow the target's exact marginals (N = 3000, V = 8;
    false-failure probability 5e-4). Eight generations at a time, each row planned by its own policy (a row whose
    policy is not the engine's is planned and taught alone, in a shared round too)."""
    from verispec.decoding.policies.cost_aware import CostAwareK

    target, draft = small_vocab_pair
    params, steps, n = SamplingParams(temperature=1.0), 5, 3000
    exact = _exact_marginals(target, [3, 1, 2], params, steps)
    counts = torch.zeros(steps, 8, dtype=torch.long)
    eng = make_engine(target, draft, k="auto", slots=8)
    timed = eng._time_draft_step
    eng._time_draft_step = lambda row: timed(row) and 1e-9
    policies = []

    def fresh_policy(row) -> None:  # nothing learnt from earlier generations
        row.policy = CostAwareK(k_max=4)
        row.policy.start()
        policies.append(row.policy)

    results = seeded_results(eng, [3, 1, 2], params, n, steps + 2, seed0=20_000, admitted=fresh_policy)
    learned = sum(policy.by_source["model"].costs.t_draft is not None for policy in policies)
    drafted = sum(result.stats.draft_forwards > 0 for result in results)
    for result in results:
        for pos, tok in enumerate(result.token_ids[:steps]):
            counts[pos, tok] += 1
    assert learned == n and drafted > 2000  # the rounds after the filler drafted with the model
    for pos in range(steps):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_loop_negative_control_fails(small_vocab_pair, monkeypatch):
    """The same test on a loop whose verifier accepts every draft must fail (emits q's marginals)."""
    target, draft = small_vocab_pair
    params = SamplingParams(temperature=1.0)

    def always_accept(draft_tokens, draft_probs, target_probs, rng):
        k = draft_tokens.shape[1]
        bonus = torch.multinomial(target_probs[:, k], 1, generator=rng).squeeze(-1)
        return torch.full((draft_tokens.shape[0],), k), bonus

    monkeypatch.setattr("verispec.core.rows.rejection_sample", always_accept)
    exact = _exact_marginals(target, [3, 1, 2], params, 3)  # token 1 from the prefill, token 2 drafted
    counts = _engine_histograms(target, draft, params, n=3000, k=2, steps=3, seed0=0)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(3)) < ALPHA


# -- a quantised draft: only acceptance may change, never the output --------------------------------


def _quantized(model, mode):
    import copy

    from verispec.backends.quant import quantize_model

    return quantize_model(copy.deepcopy(model), mode)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("k", [1, 4])
def test_quantized_draft_greedy_identical(pair, k, mode):
    target, draft = pair
    q = _quantized(draft, mode)
    plain = make_engine(target).generate([3, 1, 4], max_new_tokens=40)
    spec = make_engine(target, q, k=k).generate([3, 1, 4], max_new_tokens=40)
    assert spec.token_ids == plain.token_ids and spec.stats.accepted > 0
