"""Cost-aware adaptive k: the policy's arithmetic, limits, switching off for a useless draft, exactness."""

from __future__ import annotations

import pytest

from tiny import make_engine, perturbed, tiny_qwen2
from verispec.adaptive import AdaptiveK


def test_expected_tokens_and_choice():
    policy = AdaptiveK(k_max=4, acceptance=[0.9, 0.8, 0.5, 0.1])
    assert policy.expected_tokens(0) == 1.0
    assert policy.expected_tokens(2) == pytest.approx(1 + 0.9 + 0.72)
    policy.t_draft, policy.t_verify = 0.0, {0: 1.0, 4: 1.0}  # free drafts: draft as many as allowed
    assert policy.choose(limit=10) == 4 and policy.choose(limit=2) == 2 and policy.choose(limit=0) == 0
    policy.t_draft = 10.0  # drafts cost far more than they save: plain decoding
    assert policy.choose(limit=10) == 0


def test_probes_while_off_and_learns_back():
    policy = AdaptiveK(k_max=4, probe_every=5, acceptance=[0.0] * 4)
    policy.t_draft, policy.t_verify = 0.3, {0: 1.0}
    picks = [policy.choose(limit=10) for _ in range(35)]
    assert [i for i, k in enumerate(picks) if k == 1] == [4, 14, 34]  # failed probes back off: 5, 10, 20 rounds
    assert set(picks) == {0, 1}
    for _ in range(30):  # the draft turns out to be good after all
        policy.update(4, 4, 4 * 0.05, 1.0)
    assert policy.choose(limit=10) == 4


def test_one_probe_recovers_from_a_slow_spell():
    """Drafts measured during a slow spell (50x their real cost) switch drafting off; the first probe's
    cost replaces that estimate, so drafting resumes right after it instead of after many probes."""
    policy = AdaptiveK(k_max=4, probe_every=5, acceptance=[0.9] * 4)
    policy.t_draft, policy.t_verify = 1.0, {0: 0.1, 1: 0.1, 4: 0.1}
    picks = [policy.choose(limit=100) for _ in range(5)]
    assert picks == [0, 0, 0, 0, 1]
    policy.update(1, 1, 0.02, 0.1)
    assert policy.t_draft == pytest.approx(0.02) and policy.choose(limit=100) == 4


def test_plain_cost_measured_and_unmeasured_k_explored():
    """llama.cpp-like costs: a verify pass over k drafts costs 0.1 + 0.1 k, plain decoding 0.1, and 60% of drafts
    are accepted: no k pays. The policy measures plain decoding once, assumes an unmeasured k costs what the
    nearest measured smaller k does (so it tries it), and after at most k_max exploring rounds decodes plainly."""
    policy = AdaptiveK(k_max=8)
    policy.update(4, 4, 4 * 0.01, 0.5)
    assert policy.choose(limit=10) == 0  # k = 0 not measured yet: measure it
    policy.update(0, 0, 0.0, 0.1)
    assert policy.verify_cost(2) == pytest.approx(0.1) and policy.verify_cost(8) == pytest.approx(0.5)
    picks = []
    for i in range(200):
        k = policy.choose(limit=100)
        picks.append(k)
        policy.update(k, [1, 0, 1, 1, 0][i % 5] * k, 0.01 * k, 0.1 + 0.1 * k)
    assert sum(k > 0 for k in picks[:20]) <= 8 and set(picks[20:]) <= {0, 1}
    assert picks[-100:].count(0) >= 90  # only the rare k = 1 probes
    policy.t_verify = {0: 0.1, 4: 0.12}  # transformers-like: nearly flat -> draft
    assert policy.choose(limit=10) >= 2
    assert policy.verify_cost(6) == pytest.approx(0.12) and policy.verify_cost(3) == pytest.approx(0.1)


def test_small_measured_k_does_not_cap_k():
    """Only k = 0 and 1 measured (a short first generation), llama.cpp-like (a 2-token pass 1.45x plain): a line
    through them would price k = 3 at 2.35x (measured here: ~1.5-2.0x) and keep a free, well-accepted drafter
    at k = 1. Unmeasured k are priced at the nearest measured smaller k, so larger k get tried, one past the
    largest measured k at a time: a well-accepted drafter climbs to k_max in one round per k."""
    policy = AdaptiveK(k_max=8, acceptance=[0.9] * 8)
    policy.t_draft, policy.t_verify = 0.0, {0: 0.08, 1: 0.115}
    assert policy.verify_cost(3) == pytest.approx(0.115)
    picks = []
    for _ in range(8):
        picks.append(policy.choose(limit=50))
        policy.update(picks[-1], picks[-1], 0.0, 0.115 + 0.01 * picks[-1])
    assert picks == [2, 3, 4, 5, 6, 7, 8, 8]


def test_exploration_climbs_only_while_drafts_are_accepted():
    """A fresh free drafter at the prior acceptance (0.6) on llama.cpp-like costs: k = 8 priced at the 2-token
    cost looks like 0.6 of plain's cost per token, but it is not a candidate until k = 2..7 were measured. Drafts
    that are all rejected switch drafting off (but for k = 1 probes), never having paid for a 9-token pass."""
    policy = AdaptiveK(k_max=8, t_verify={0: 0.1, 1: 0.15})
    assert policy.seconds_per_token(8) < policy.seconds_per_token(2)  # the old choice: k = 8
    picks = []
    for _ in range(20):
        picks.append(policy.choose(limit=100))
        policy.update(picks[-1], 0, 0.0, 0.1 + 0.05 * picks[-1])
    assert picks[0] == 2 and max(picks) == 2 and set(picks[1:]) <= {0, 1} and picks[1:].count(0) >= 17


def test_expensive_catch_up_spaces_probes():
    """A probe with a draft model costs a catch-up over the skipped tokens: with a 1 s catch-up and 0.1 s
    plain rounds, probes come at most every 1 / (0.02 * 0.1) = 500 rounds."""
    policy = AdaptiveK(k_max=4, probe_every=5, acceptance=[0.0] * 4)
    policy.t_draft, policy.t_verify = 0.3, {0: 0.1, 1: 0.2}
    policy.update(1, 0, 0.3, 0.2, catchup_seconds=1.0)
    picks = [policy.choose(limit=10) for _ in range(1000)]
    assert [i for i, k in enumerate(picks) if k == 1] == [499, 999]


def test_probe_catch_up_is_paid_by_its_own_generation():
    """Plain rounds of earlier generations do not pay for a probe: with a 1 s catch-up and 0.1 s rounds a probe
    needs 500 plain rounds in the same generation, so generations of 100 rounds never probe (before, the 5th
    one did, at its start, and that prompt alone paid 1 s: ~10% of it)."""
    policy = AdaptiveK(k_max=4, probe_every=5, acceptance=[0.0] * 4)
    policy.t_draft, policy.t_verify = 0.3, {0: 0.1, 1: 0.2}
    policy.update(1, 0, 0.3, 0.2, catchup_seconds=1.0, catchup_tokens=100)
    picks = []
    for _ in range(10):
        policy.new_generation()
        picks += [policy.choose(limit=100, pending=100) for _ in range(100)]
    assert set(picks) == {0}
    policy.new_generation()
    long = [policy.choose(limit=1000, pending=100) for _ in range(600)]
    assert [i for i, k in enumerate(long) if k == 1] == [499]
    sub = policy.for_source("model")  # sub-policies start their budget over with the generation too
    sub.t_draft, sub.t_catchup = 0.3, 1.0
    sub._gen_off_rounds = 400
    policy.new_generation()
    assert sub._gen_off_rounds == 0


def test_catch_up_must_pay_for_itself():
    """Drafting saves 0.05 s a token here; a draft 100 tokens behind at 0.01 s a catch-up token costs 1 s:
    worth it for 30 remaining tokens only when less than 1.5 s of catch-up is pending."""
    policy = AdaptiveK(k_max=4, acceptance=[1.0] * 4)
    # measured: k drafts cost 0.1 + 0.0125 k; 4 drafts: (0.1 + 0.15) / 5 = 0.05 s a token
    policy.t_draft, policy.t_verify = 0.025, {k: 0.1 + 0.0125 * k for k in range(5)}
    assert policy.seconds_per_token(4) == pytest.approx(0.05)
    policy.update(4, 4, 0.1, 0.15, catchup_seconds=2.0, catchup_tokens=200)
    assert policy.t_catchup_token == pytest.approx(0.01)
    assert policy.choose(limit=30, pending=100) == 4
    assert policy.choose(limit=30, pending=160) == 0
    assert policy.choose(limit=30, pending=0) == 4


@pytest.mark.parametrize("t_verify_2, step, drafts", [(0.15, 0.05, False), (0.1, 0.01, True)],
                         ids=["llamacpp-like", "transformers-like"])
def test_fresh_policy_learns_costs_before_drafting(t_verify_2, step, drafts):
    """A fresh policy decodes plainly first (measuring plain decoding), verifies one free guess (a 2-token
    pass: the k = 1 cost), then asks for one timed draft step, and only then decides. llama.cpp-like costs (a
    2-token pass 1.5x plain, a draft step half of plain): (0.05 + 0.15) / 1.6 > 0.1 a token, so it never
    drafts (before, it drafted k_max blind, twice). Transformers-like (flat verify, a step 0.1 of plain):
    it drafts."""
    policy = AdaptiveK(k_max=8)
    assert policy.choose(limit=50) == 0 and not policy.filler and not policy.wants_draft_cost()
    policy.observe_verify(1, 0.1)
    assert policy.choose(limit=50) == 1 and policy.filler and not policy.wants_draft_cost()
    policy.observe_verify(2, t_verify_2)
    assert policy.t_verify == {0: 0.1, 1: t_verify_2} and policy.wants_draft_cost()
    policy.observe_draft_step(step)
    assert not policy.wants_draft_cost()
    k = policy.choose(limit=50)
    assert not policy.filler and (k > 0) == drafts
    assert policy.choose(limit=0) == 0 and not policy.filler


def test_free_drafter_is_priced_free_until_measured():
    """A source whose draft cost cannot be timed beforehand (n-gram: free) is priced as free once the verify
    costs are known: it drafts as far as the measured costs allow (one past the largest measured k) and
    learns its cost from that round; it does not draft where even free drafts cannot pay."""
    policy = AdaptiveK(k_max=6, t_verify={0: 0.1, 1: 0.12, 4: 0.13})
    assert policy.t_draft is None and policy.choose(limit=50) == 5 and not policy.filler
    assert policy.choose(limit=3) == 3
    policy.update(3, 3, 0.003, 0.125)
    assert policy.t_draft == pytest.approx(0.001)
    hopeless = AdaptiveK(k_max=6, t_verify={0: 0.1, 1: 0.3}, prior_acceptance=0.1)
    assert hopeless.choose(limit=50) == 0 and not hopeless.filler


def test_catch_up_estimated_from_the_target_prefill():
    """Before the draft has caught up once, its catch-up is estimated as the target's prefill cost per token
    scaled by the draft/target step ratio: 13 ms x 0.2 = 2.6 ms a token. Drafting saves 0.056 s a token here,
    1.68 s over 30 tokens: worth 500 pending tokens (1.3 s), not 700 (1.82 s)."""
    policy = AdaptiveK(k_max=4)
    policy.observe_prefill(1.3, 100)
    policy.observe_prefill(5.0, 10)  # too few tokens to say anything per token: ignored
    assert policy.t_prefill_token == pytest.approx(0.013)
    model = policy.for_source("model")
    model.acceptance = [0.9] * 4
    policy.t_verify.update({0: 0.1, 4: 0.1})
    assert model.catchup_token_cost() is None  # the draft's step cost is not known yet
    model.observe_draft_step(0.02)
    assert model.catchup_token_cost() == pytest.approx(0.0026)
    assert model.choose(limit=30, pending=500) == 4
    assert model.choose(limit=30, pending=700) == 0
    model.update(4, 4, 0.08, None, catchup_seconds=0.1, catchup_tokens=100)  # measured: replaces the estimate
    assert model.catchup_token_cost() == pytest.approx(0.001) and model.choose(limit=30, pending=700) == 4


def test_draft_model_time_step_is_part_of_its_catch_up(target):
    """time_step feeds committed tokens the draft has not seen, one per pass: the drafts that follow are those
    of a draft that never timed a step."""
    from verispec.backends import HFModel
    from verispec.proposers import DraftModelProposer
    from verispec.sampling import SamplingParams
    from verispec.sequence import TokenSequence

    import torch

    drafts = []
    for timed in (False, True):
        proposer = DraftModelProposer(HFModel(tiny_qwen2(3)), 64)
        seq = TokenSequence(list(range(1, 11)), 40, torch.device("cpu"))
        proposer.start(seq, SamplingParams(), torch.Generator())
        if timed:
            assert proposer.time_step(seq) > 0 and proposer.time_step(seq) > 0
            assert proposer.model.length == 2 and proposer.pending(seq) == 7
        drafts.append(proposer.propose(seq, 4).tokens.tolist())
    assert drafts[0] == drafts[1]
    short = TokenSequence([1], 40, torch.device("cpu"))
    proposer.start(short, SamplingParams(), torch.Generator())
    assert proposer.time_step(short) is None and proposer.model.length == 0  # nothing to spare


def test_draft_model_reports_pending_catch_up(target):
    from verispec.backends import HFModel
    from verispec.proposers import DraftModelProposer
    from verispec.sampling import SamplingParams
    from verispec.sequence import TokenSequence

    import torch

    proposer = DraftModelProposer(HFModel(tiny_qwen2(3)), 64)
    seq = TokenSequence(list(range(1, 11)), 40, torch.device("cpu"))
    proposer.start(seq, SamplingParams(), torch.Generator())
    assert proposer.pending(seq) == 9  # the prompt but its last token, fed with the first draft step
    proposer.propose(seq, 2)
    assert proposer.catchup_tokens == 9 and proposer.catchup_seconds > 0
    proposer.observe(seq, 2, 0)
    seq.extend([5], torch.tensor([5]))
    assert proposer.pending(seq) == 0


def test_update_only_reached_positions():
    policy = AdaptiveK(k_max=4, decay=0.5, prior_acceptance=0.5)
    policy.update(4, 1, 0.4, 1.0)  # position 0 accepted, position 1 rejected, 2-3 never reached
    assert policy.acceptance == [0.75, 0.25, 0.5, 0.5]
    assert policy.t_draft == pytest.approx(0.1) and policy.t_verify == {4: 1.0}
    with pytest.raises(ValueError):
        AdaptiveK(k_max=0)
    policy.update(2, 2, 0.2, 1.0)  # k = 2, both accepted: positions 2-3 unobserved, drift towards the one before
    assert policy.acceptance[:2] == [0.875, 0.625]
    assert policy.acceptance[2] == pytest.approx(0.5 + 0.05 * (0.625 - 0.5))


def test_deeper_positions_get_tried_again():
    """A bad early estimate at position 4 must not cap k forever: while k = 3 keeps being fully accepted,
    position 4's estimate drifts up until k = 4 and beyond are tried."""
    policy = AdaptiveK(k_max=6, acceptance=[0.9, 0.9, 0.9, 0.0, 0.0, 0.0])
    policy.t_draft, policy.t_verify = 0.02, {0: 1.0, 3: 1.0}
    assert policy.choose(limit=100) == 3
    picks = []
    for _ in range(100):
        k = policy.choose(limit=100)
        picks.append(k)
        policy.update(k, k, 0.02 * k, 1.0)  # every draft accepted
    assert max(picks) == 6


@pytest.fixture(scope="module")
def target():
    return tiny_qwen2(1)


def test_useless_draft_switches_speculation_off(target):
    """A draft with unrelated random weights: adaptive k falls to 0 (plain decoding) for most rounds,
    within limits, and the output stays identical to plain decoding."""
    useless = tiny_qwen2(99)
    eng = make_engine(target, useless, k="auto")
    chosen = []
    real_choose = eng.k_policy.choose
    eng.k_policy.choose = lambda limit, pending=0: chosen.append((real_choose(limit, pending), limit)) or chosen[-1][0]
    out = eng.generate([1, 2, 3], max_new_tokens=120)
    assert out.token_ids == make_engine(target).generate([1, 2, 3], max_new_tokens=120).token_ids
    assert all(0 <= k <= min(limit, 8) for k, limit in chosen)
    tail = [k for k, _ in chosen[len(chosen) // 2 :]]
    assert tail.count(0) >= 0.8 * len(tail)


def test_free_accurate_drafts_use_large_k(target):
    """n-gram drafts on a repetitive prompt cost ~nothing and are mostly accepted: k goes up to k_max."""
    prompt = [5, 6, 7, 8, 9, 10] * 8
    plain = make_engine(target).generate(prompt, max_new_tokens=60).token_ids
    eng = make_engine(target, k="auto", drafter="ngram")
    out = eng.generate(prompt, max_new_tokens=60)
    assert out.token_ids == plain
    assert eng.k_policy.choose(limit=100) >= 4 or out.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("k", ["auto"])
def test_auto_with_draft_model_is_exact(target, k):
    draft = perturbed(target, seed=2, noise=0.05)
    plain = make_engine(target).generate([4, 2], max_new_tokens=50).token_ids
    assert make_engine(target, draft, k=k).generate([4, 2], max_new_tokens=50).token_ids == plain


def test_sources_have_their_own_policies():
    policy = AdaptiveK(k_max=4)
    ngram, model = policy.for_source("ngram"), policy.for_source("model")
    assert policy.for_source(None) is policy and policy.for_source("ngram") is ngram and ngram is not model
    ngram.update(4, 4, 0.0, 0.2)
    model.update(4, 0, 4 * 0.5, 0.2)
    assert policy.t_verify == {4: 0.2} and model.t_verify is policy.t_verify  # verify costs are shared
    assert ngram.acceptance[0] > policy.prior_acceptance > model.acceptance[0]
    assert ngram.t_draft == 0.0 and model.t_draft == 0.5


def test_model_source_switches_off_while_ngram_drafts_go_on():
    """Hybrid rounds on a llama.cpp-like target: n-gram drafts are free and accepted, model drafts cost
    0.3 of a verify pass and are rejected. The model's sub-policy falls to k = 0; the n-gram one drafts on."""
    policy = AdaptiveK(k_max=4)
    policy.update(0, 0, 0.0, 0.1)
    for _ in range(30):
        ngram = policy.for_source("ngram")
        k = ngram.choose(limit=100)
        ngram.update(k, k, 0.0, 0.1 + 0.02 * k)
        model = policy.for_source("model")
        k = model.choose(limit=100)
        model.update(k, 0, 0.03 * k, 0.1 + 0.02 * k)
    assert policy.for_source("ngram").choose(limit=100) == 4
    assert policy.for_source("model").choose(limit=100) == 0


def test_hybrid_auto_is_exact(target):
    prompt = [5, 6, 7, 8, 9, 10] * 8
    plain = make_engine(target).generate(prompt, max_new_tokens=80).token_ids
    eng = make_engine(target, tiny_qwen2(99), k="auto", drafter="hybrid")
    assert eng.generate(prompt, max_new_tokens=80).token_ids == plain
    assert set(eng.k_policy.by_source) <= {"ngram", "model"} and eng.k_policy.by_source


def test_verify_cost_never_decreases_with_k():
    """One slow plain round (a timing spike) must not make plain decoding look dearer than verifying k
    drafts: the estimate for k is capped by every measured larger k."""
    policy = AdaptiveK(k_max=4, t_verify={0: 0.5, 2: 0.1, 4: 0.12})
    assert policy.verify_cost(0) == pytest.approx(0.1) and policy.verify_cost(1) == pytest.approx(0.1)
    assert policy.verify_cost(3) == pytest.approx(0.1)


def test_engine_learns_costs_before_the_draft_runs(target):
    """A fresh engine with k = auto: the prompt, the first token from its logits, a plain pass, a filler pass
    (2 tokens) on the target before the draft model runs at all; its first pass is a single timed step. The
    output is plain decoding's."""
    from verispec.backends import HFModel
    from verispec.engine import SpeculativeGenerator
    from verispec.proposers import DraftModelProposer

    log = []

    class Logged(HFModel):
        def __init__(self, model, name):
            super().__init__(model)
            self.name = name

        def forward(self, tokens, last_only=False):
            log.append((self.name, tokens.numel()))
            return super().forward(tokens, last_only)

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = make_engine(target).generate(prompt, max_new_tokens=30).token_ids
    t = Logged(target, "T")
    draft = DraftModelProposer(Logged(perturbed(target, seed=2, noise=0.05), "D"), t.vocab_size)
    eng = SpeculativeGenerator(t, draft, num_draft_tokens="auto")
    assert eng.generate(prompt, max_new_tokens=30).token_ids == plain
    assert log[:4] == [("T", 8), ("T", 1), ("T", 2), ("D", 1)]


@pytest.mark.parametrize("drafter", ["model", "ngram", "hybrid"])
@pytest.mark.parametrize("prompt", [[7], [3, 1, 4, 1, 5], [5, 6, 7, 8, 9, 10] * 6])
def test_fresh_auto_greedy_identical(target, drafter, prompt):
    """Every generation from a fresh policy (filler rounds, timed steps, then drafting or not): plain's tokens."""
    draft = perturbed(target, seed=2, noise=0.05) if drafter != "ngram" else None
    plain = make_engine(target).generate(prompt, max_new_tokens=40).token_ids
    for max_new in (1, 2, 3, 40):
        eng = make_engine(target, draft, k="auto", drafter=drafter)
        assert eng.generate(prompt, max_new_tokens=max_new).token_ids == plain[:max_new]


def test_a_thin_predicted_gain_is_not_enough():
    """Speculation must be predicted to save at least `margin` (5%) of plain decoding's cost per token: a 3%
    predicted gain is within the noise of the measurements it comes from, so it decodes plainly."""
    policy = AdaptiveK(k_max=1, acceptance=[0.9])
    policy.t_verify = {0: 0.1, 1: 0.1}
    policy.t_draft = 1.9 * 0.97 * 0.1 - 0.1  # k = 1: 1.9 tokens for (t_draft + 0.1) s, 0.97 of plain's cost
    assert policy.seconds_per_token(1) == pytest.approx(0.097)
    assert policy.choose(limit=50) == 0
    policy.t_draft = 1.9 * 0.90 * 0.1 - 0.1  # a 10% gain: draft
    assert policy.choose(limit=50) == 1
    policy.margin = 0.0
    policy.t_draft = 1.9 * 0.97 * 0.1 - 0.1
    assert policy.choose(limit=50) == 1


def drafting_policy():
    """Estimates say k = 4 saves 40%: 0.9 acceptance, free drafts, verify flat at plain's 0.1 s."""
    policy = AdaptiveK(k_max=4, probe_every=5, acceptance=[0.9] * 4)
    policy.t_draft, policy.t_verify = 0.0, {0: 0.1, 4: 0.1}
    return policy


def test_measured_losses_bench_the_source_until_a_probe():
    """Rounds that the estimates call cheap but that take 0.6 s for their 5 tokens (plain: 0.5 s; an unseen
    cost, say slow rollbacks) bench the source after judge_after = 4 rounds: plain decoding, whatever the
    estimates say, until a probe. The probe interval backs off (5 -> 10) and the probe judges afresh."""
    policy = drafting_policy()
    picks = []
    for _ in range(30):
        k = policy.choose(limit=100)
        picks.append(k)
        if k:
            policy.update(k, k, 0.0, None, round_seconds=0.6 if k == 4 else 0.1, plain_tokens=k + 1)
    assert picks[:4] == [4] * 4 and picks[4:13] == [0] * 9 and picks[13] == 1  # a probe after 10 rounds
    assert picks[14:18] == [4] * 4 and picks[18] == 0  # the probe's k = 1 round looked fine: judged again
    assert policy._benched and policy._interval >= 20


def test_one_bad_round_in_a_saving_spell_does_not_bench():
    """A spell that saves on the whole (0.3 s for 5 tokens; now and then a rejected round costs 0.3 s for 1
    token) keeps drafting: it is the running mean that is judged, not a round."""
    policy = drafting_policy()
    picks = []
    for i in range(40):
        k = policy.choose(limit=100)
        picks.append(k)
        accepted = 0 if i % 5 == 3 else k
        policy.update(k, accepted, 0.0, None, round_seconds=0.3, plain_tokens=accepted + 1)
    assert set(picks) == {4} and not policy._benched


def test_saving_judged_against_plain_passes_not_tokens():
    """The first round's first token comes from the prefill's logits: plain decoding pays no pass for it, so
    that round's saving counts only the passes plain decoding would have made (plain_tokens = accepted)."""
    policy = drafting_policy()
    policy.judge_after = 1
    policy.update(4, 4, 0.0, None, round_seconds=0.45, plain_tokens=4)  # 4 passes: 0.4 s < 0.45 s, a loss
    assert policy._benched
    policy = drafting_policy()
    policy.judge_after = 1
    policy.update(4, 4, 0.0, None, round_seconds=0.45, plain_tokens=5)
    assert not policy._benched


def test_engine_benches_a_draft_with_costs_the_estimates_miss(target):
    """A target pass that takes 20 ms, a draft that agrees with it at ~1 ms a step, but whose rollback after
    every round costs 0.3 s, more than a round of 9 tokens saves: the estimates (draft steps, verify passes)
    keep predicting a win, the measured rounds bench the draft after judge_after rounds. Output: plain's."""
    import time

    from verispec.backends import HFModel
    from verispec.engine import SpeculativeGenerator
    from verispec.proposers import DraftModelProposer

    class SlowTarget(HFModel):
        def forward(self, tokens, last_only=False):
            time.sleep(0.02)
            return super().forward(tokens, last_only)

    class SlowRollback(DraftModelProposer):
        def observe(self, seq, drafted, accepted):
            time.sleep(0.3)
            super().observe(seq, drafted, accepted)

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = make_engine(target).generate(prompt, max_new_tokens=50).token_ids
    eng = SpeculativeGenerator(SlowTarget(target), SlowRollback(HFModel(target), target.config.vocab_size),
                               num_draft_tokens="auto")
    rounds = []
    real = eng._round
    eng._round = lambda seq, k, *a: rounds.append(k) or real(seq, k, *a)
    assert eng.generate(prompt, max_new_tokens=50).token_ids == plain
    policy = eng.k_policy
    assert policy._benched and sum(k > 0 for k in rounds) == 1 + policy.judge_after  # the filler, 4 judged rounds
    assert rounds[-1] == 0 and policy.choose(limit=10) == 0
