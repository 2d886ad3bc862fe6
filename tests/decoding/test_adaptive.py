"""Cost-aware adaptive k: each part alone (the cost model, the acceptance estimate, the probe gate), one source's
policy composing them, the KPolicy over sources, and the engine with it: switching off for a useless draft,
exactness."""

from __future__ import annotations

import pytest
import torch
from tiny import make_engine, perturbed, tiny_qwen2

from verispec.core.sequence import TokenSequence
from verispec.decoding.policies.base import Plan, RoundReport, RoundView
from verispec.decoding.policies.cost_aware import (
    GUESS_NGRAM,
    AcceptanceEstimate,
    CostAwareK,
    CostModel,
    ProbeGate,
    SourcePolicy,
    TargetCosts,
)
from verispec.proposers.ngram import NgramIndex


def make_policy(k_max: int = 8, acceptance: list[float] | None = None, t_draft: float | None = None,
                t_verify: dict[int, float] | None = None, prior: float = 0.6, decay: float = 0.85,
                **gate) -> SourcePolicy:
    """One source's policy on a target of its own, from plain numbers; `gate`: ProbeGate's other settings."""
    costs = CostModel(TargetCosts(decay, dict(t_verify or {})), decay, t_draft)
    acceptance = AcceptanceEstimate(k_max, decay, prior, rates=list(acceptance or []))
    return SourcePolicy(costs, acceptance, ProbeGate(decay=decay, **gate))


def run_round(policy: SourcePolicy, k: int, accepted: int, draft_seconds: float, verify_seconds: float | None,
              **kwargs) -> None:
    """A round of k drafts as CostAwareK reports it: the verify pass over k + 1 tokens (None: no such pass) to the
    shared target costs, the rest to the source's policy."""
    if verify_seconds is not None:
        policy.costs.target.observe_verify(k + 1, verify_seconds)
    policy.observe(k, accepted, draft_seconds, **kwargs)


class StepTimer:
    """A RoundView.time_draft_step: returns `seconds` and counts its calls."""

    def __init__(self, seconds: float | None = None) -> None:
        self.seconds, self.calls = seconds, 0

    def __call__(self) -> float | None:
        self.calls += 1
        return self.seconds


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5]


def view(limit: int, source: str = "model", pending: int = 0, timer: StepTimer | None = None) -> RoundView:
    seq = TokenSequence(PROMPT, 64, torch.device("cpu"))
    return RoundView(seq, limit, source, pending, timer or StepTimer())


def report(drafted: int, accepted: int, verify_seconds: float, draft_seconds: float = 0.0, own_draft: bool = False,
           first: bool = False, catchup_seconds: float = 0.0, catchup_tokens: int = 0,
           seconds: float | None = None, fed: int | None = None) -> RoundReport:
    """A round's report (its wall time: its parts' sum unless given; its pass fed the last committed token and the
    drafts unless `fed` is given: a first round's pass holds the prompt too)."""
    if seconds is None:
        seconds = catchup_seconds + draft_seconds + verify_seconds
    steps = 0 if own_draft else drafted
    return RoundReport(k=drafted, source="x" if drafted else "", drafted=drafted, accepted=accepted,
                       fed=drafted + 1 if fed is None else fed, first=first, own_draft=own_draft, draft_steps=steps, draft_seconds=draft_seconds,
                       verify_seconds=verify_seconds, catchup_seconds=catchup_seconds, catchup_tokens=catchup_tokens,
                       seconds=seconds)


# -- the cost model ------------------------------------------------------------------------------------


def test_unmeasured_verify_cost_is_the_nearest_smaller_measured_k():
    """Not a line through the measurements, not the largest or smallest measured k: the nearest smaller one; below
    every measured k, the cheapest larger one. Candidates reach one past the largest measured k."""
    costs = TargetCosts(t_verify={0: 0.1, 2: 0.3, 5: 0.4})
    assert [costs.verify(k) for k in range(8)] == pytest.approx([0.1, 0.1, 0.3, 0.3, 0.3, 0.4, 0.4, 0.4])
    assert costs.frontier() == 6 and costs.knows_plain
    above = TargetCosts(t_verify={2: 0.3, 5: 0.2})
    assert not above.knows_plain and above.verify(0) == pytest.approx(0.2) and above.verify(1) == pytest.approx(0.2)


def test_verify_cost_never_decreases_with_k():
    """One slow plain round (a timing spike) must not make plain decoding look dearer than verifying k
    drafts: the estimate for k is capped by every measured larger k."""
    costs = TargetCosts(t_verify={0: 0.5, 2: 0.1, 4: 0.12})
    assert costs.verify(0) == pytest.approx(0.1) and costs.verify(1) == pytest.approx(0.1)
    assert costs.verify(3) == pytest.approx(0.1)


def test_target_costs_are_running_means():
    """A pass over n tokens is the cost of k = n - 1 drafts; a prefill of fewer than 16 tokens says nothing per
    token (the pass's fixed cost dominates)."""
    costs = TargetCosts(decay=0.5)
    costs.observe_verify(3, 1.0)
    costs.observe_verify(3, 0.0)
    costs.observe_verify(1, 0.2)
    assert costs.t_verify == {2: 0.5, 0: 0.2}
    costs.observe_prefill(9.0, 15)
    assert costs.t_prefill_token is None
    costs.observe_prefill(1.6, 16)
    costs.observe_prefill(0.0, 100)
    assert costs.t_prefill_token == pytest.approx(0.05)
    with pytest.raises(ValueError):
        TargetCosts(decay=1.0)


def test_draft_cost_per_step():
    """A round's draft time is per step; a running mean unless the measurement replaces the estimate; a timed
    step replaces it too."""
    costs = CostModel(TargetCosts(), decay=0.5)
    costs.observe_draft(4, 0.4)
    assert costs.t_draft == pytest.approx(0.1)
    costs.observe_draft(2, 0.4)
    assert costs.t_draft == pytest.approx(0.15)
    costs.observe_draft(2, 0.4, replace=True)
    assert costs.t_draft == pytest.approx(0.2)
    costs.observe_draft_step(0.03)
    assert costs.t_draft == 0.03


def test_seconds_per_token():
    """(k t_draft + t_verify(k)) / E(k); an unmeasured draft step is priced as free."""
    costs = CostModel(TargetCosts(t_verify={0: 0.1, 3: 0.16}))
    assert costs.seconds_per_token(3, 2.0) == pytest.approx(0.08)
    costs.t_draft = 0.02
    assert costs.seconds_per_token(3, 2.2) == pytest.approx(0.1)
    assert costs.seconds_per_token(0, 1.0) == pytest.approx(0.1)
    assert costs.seconds_per_token(2, 1.5) == pytest.approx((0.04 + 0.1) / 1.5)  # k = 2 priced at k = 0's pass


def test_catch_up_cost_measured_else_estimated_from_the_prefill():
    """Per token: measured; until then the target's prefill per token x t_draft / t_verify(0); unknown without
    them. A catch-up of no tokens, or with no time, teaches nothing per token."""
    target = TargetCosts(t_verify={1: 0.1})
    costs = CostModel(target, decay=0.5, t_draft=0.02)
    assert costs.catchup_token_cost() is None and costs.catchup_cost(50) is None  # no prefill measured
    target.t_prefill_token = 0.01
    assert costs.catchup_token_cost() is None  # t_verify(0) not measured
    target.t_verify[0] = 0.1
    assert costs.catchup_token_cost() == pytest.approx(0.002)
    assert costs.catchup_cost(50) == pytest.approx(0.1) and costs.catchup_cost(0) is None
    costs.observe_catchup(0.0, 50)
    assert costs.t_catchup == 0.0 and costs.t_catchup_token is None
    costs.observe_catchup(1.0, 0)
    assert costs.t_catchup == 1.0 and costs.t_catchup_token is None
    costs.observe_catchup(2.0, 100)
    costs.observe_catchup(0.4, 100)
    assert costs.t_catchup == 0.4 and costs.catchup_token_cost() == pytest.approx(0.012)
    assert costs.catchup_cost(50) == pytest.approx(0.6)


# -- the acceptance estimate ---------------------------------------------------------------------------


def test_expected_tokens_multiply_along_the_draft():
    """E(k) sums the chances that every draft up to j is accepted: a position with a_i = 0 ends the run, whatever
    comes after it."""
    acceptance = AcceptanceEstimate(4, rates=[0.5, 0.5, 0.0, 1.0])
    assert [acceptance.expected_tokens(k) for k in range(5)] == pytest.approx([1.0, 1.5, 1.75, 1.75, 1.75])


def test_acceptance_learns_reached_positions_and_drifts_the_rest():
    """Only the positions a round reached learn (accepted ones towards 1, the first rejected towards 0); each
    position beyond the draft moves `explore` of the way towards the one before it, already moved."""
    acceptance = AcceptanceEstimate(4, decay=0.5, prior=0.5, explore=0.1)
    acceptance.observe(1, 1)
    assert acceptance.rates == pytest.approx([0.75, 0.525, 0.5025, 0.50025])
    acceptance.observe(4, 0)  # rejected at once: only position 0 reached, none beyond the draft
    assert acceptance.rates == pytest.approx([0.375, 0.525, 0.5025, 0.50025])
    acceptance.observe(0, 0)  # no draft: nothing to learn
    assert acceptance.rates == pytest.approx([0.375, 0.525, 0.5025, 0.50025])
    with pytest.raises(ValueError):
        AcceptanceEstimate(0)
    with pytest.raises(ValueError):
        AcceptanceEstimate(3, rates=[0.5, 0.5])


# -- the probe gate ------------------------------------------------------------------------------------


def test_gate_admits_only_a_gain_beyond_the_margin():
    gate = ProbeGate(margin=0.05)
    assert gate.admits(0.095, 0.1) and not gate.admits(0.0951, 0.1)
    gate.benched = True
    assert not gate.admits(0.01, 0.1)


def test_gate_probes_at_doubling_intervals():
    """Off rounds probe after probe_every rounds, the interval doubling up to max_probe_every; a drafting round
    brings the interval back to probe_every."""
    gate = ProbeGate(probe_every=3, max_probe_every=8, probe_overhead=0.5)
    probes = [i for i in range(40) if gate.off_round(0.0, 0.1)]
    assert probes == [2, 8, 16, 24, 32]
    assert gate.probing
    gate.on_round()
    assert [i for i in range(10) if gate.off_round(0.0, 0.1)] == [2, 8]


def test_gate_probe_catch_up_is_paid_by_its_generation():
    """A probe's catch-up (1 s) may cost at most probe_overhead (0.5) of this generation's plain rounds (0.1 s):
    20 of them, whatever the rounds of earlier generations."""
    gate = ProbeGate(probe_every=3, probe_overhead=0.5)
    picks = []
    for _ in range(5):
        gate.new_generation()
        picks += [gate.off_round(1.0, 0.1) for _ in range(19)]
    assert not any(picks)
    gate.new_generation()
    assert [i for i in range(40) if gate.off_round(1.0, 0.1)] == [19, 39]  # interval 6, but 20 rounds a catch-up


def test_gate_benches_a_losing_source_and_backs_off():
    """After judge_after drafting rounds whose running mean saving is negative the source is benched (until a
    probe, after twice the interval each time); a probe's own round is not judged; a saving spell resets the
    back-off."""
    gate = ProbeGate(probe_every=2, max_probe_every=100, judge_after=2, decay=0.5)
    gate.observe_drafting(-1.0)
    assert not gate.benched  # one round judged: not yet
    gate.observe_drafting(0.5)  # mean -0.25
    assert gate.benched and not gate.admits(0.0, 0.1)
    assert [i for i in range(10) if gate.off_round(0.0, 0.1)] == [3]  # a probe after 4 rounds
    assert not gate.benched and gate.probing
    gate.observe_drafting(-9.0)  # the probe's round: not judged
    assert not gate.probing and not gate.benched
    gate.observe_drafting(-1.0)
    gate.observe_drafting(None)  # not measured: not judged
    assert not gate.benched
    gate.observe_drafting(-1.0)
    assert gate.benched and [i for i in range(10) if gate.off_round(0.0, 0.1)] == [7]  # backed off: 8 rounds
    gate.observe_drafting(None)  # the probe's round
    gate.observe_drafting(1.0)
    gate.observe_drafting(0.5)  # saves: the back-off is reset
    gate.observe_drafting(-3.0)  # mean -1.125
    assert gate.benched and [i for i in range(10) if gate.off_round(0.0, 0.1)] == [3]


# -- one source's policy -------------------------------------------------------------------------------


def test_expected_tokens_and_choice():
    policy = make_policy(k_max=4, acceptance=[0.9, 0.8, 0.5, 0.1])
    assert policy.acceptance.expected_tokens(0) == 1.0
    assert policy.acceptance.expected_tokens(2) == pytest.approx(1 + 0.9 + 0.72)
    policy.costs.t_draft = 0.0  # free drafts: draft as many as allowed
    policy.costs.target.t_verify = {0: 1.0, 4: 1.0}
    assert policy.choose(limit=10) == 4 and policy.choose(limit=2) == 2 and policy.choose(limit=0) == 0
    policy.costs.t_draft = 10.0  # drafts cost far more than they save: plain decoding
    assert policy.choose(limit=10) == 0


def test_probes_while_off_and_learns_back():
    policy = make_policy(k_max=4, probe_every=5, acceptance=[0.0] * 4, t_draft=0.3, t_verify={0: 1.0})
    picks = [policy.choose(limit=10) for _ in range(35)]
    assert [i for i, k in enumerate(picks) if k == 1] == [4, 14, 34]  # failed probes back off: 5, 10, 20 rounds
    assert set(picks) == {0, 1}
    for _ in range(30):  # the draft turns out to be good after all
        run_round(policy, 4, 4, 4 * 0.05, 1.0)
    assert policy.choose(limit=10) == 4


def test_one_probe_recovers_from_a_slow_spell():
    """Drafts measured during a slow spell (50x their real cost) switch drafting off; the first probe's
    cost replaces that estimate, so drafting resumes right after it instead of after many probes."""
    policy = make_policy(k_max=4, probe_every=5, acceptance=[0.9] * 4, t_draft=1.0, t_verify={0: 0.1, 1: 0.1, 4: 0.1})
    picks = [policy.choose(limit=100) for _ in range(5)]
    assert picks == [0, 0, 0, 0, 1]
    run_round(policy, 1, 1, 0.02, 0.1)
    assert policy.costs.t_draft == pytest.approx(0.02) and policy.choose(limit=100) == 4


def test_plain_cost_measured_and_unmeasured_k_explored():
    """Costs where a verify pass over k drafts costs 0.1 + 0.1 k, plain decoding 0.1, and 60% of drafts are
    accepted: no k pays. The policy measures plain decoding once, assumes an unmeasured k costs what the
    nearest measured smaller k does (so it tries it), and after at most k_max exploring rounds decodes plainly."""
    policy = make_policy(k_max=8)
    target = policy.costs.target
    run_round(policy, 4, 4, 4 * 0.01, 0.5)
    assert policy.choose(limit=10) == 0  # k = 0 not measured yet: measure it
    run_round(policy, 0, 0, 0.0, 0.1)
    assert target.verify(2) == pytest.approx(0.1) and target.verify(8) == pytest.approx(0.5)
    picks = []
    for i in range(200):
        k = policy.choose(limit=100)
        picks.append(k)
        run_round(policy, k, [1, 0, 1, 1, 0][i % 5] * k, 0.01 * k, 0.1 + 0.1 * k)
    assert sum(k > 0 for k in picks[:20]) <= 8 and set(picks[20:]) <= {0, 1}
    assert picks[-100:].count(0) >= 90  # only the rare k = 1 probes
    target.t_verify = {0: 0.1, 4: 0.12}  # nearly flat -> draft
    assert policy.choose(limit=10) >= 2
    assert target.verify(6) == pytest.approx(0.12) and target.verify(3) == pytest.approx(0.1)


def test_small_measured_k_does_not_cap_k():
    """Only k = 0 and 1 measured (a short first generation), a 2-token pass 1.45x plain: a line through them
    would price k = 3 at 2.35x and keep a free, well-accepted drafter at k = 1. Unmeasured k are priced at the
    nearest measured smaller k, so larger k get tried, one past the largest measured k at a time: a
    well-accepted drafter climbs to k_max in one round per k."""
    policy = make_policy(k_max=8, acceptance=[0.9] * 8, t_draft=0.0, t_verify={0: 0.08, 1: 0.115})
    assert policy.costs.target.verify(3) == pytest.approx(0.115)
    picks = []
    for _ in range(8):
        picks.append(policy.choose(limit=50))
        run_round(policy, picks[-1], picks[-1], 0.0, 0.115 + 0.01 * picks[-1])
    assert picks == [2, 3, 4, 5, 6, 7, 8, 8]


def test_exploration_climbs_only_while_drafts_are_accepted():
    """A fresh free drafter at the prior acceptance (0.6) where a 2-token pass costs 1.5x plain: k = 8 priced at
    the 2-token cost looks like 0.6 of plain's cost per token, but it is not a candidate until k = 2..7 were
    measured. Drafts that are all rejected switch drafting off (but for k = 1 probes), never having paid for a
    9-token pass."""
    policy = make_policy(k_max=8, t_verify={0: 0.1, 1: 0.15})
    assert policy.seconds_per_token(8) < policy.seconds_per_token(2)  # priced on its own, k = 8 would win
    picks = []
    for _ in range(20):
        picks.append(policy.choose(limit=100))
        run_round(policy, picks[-1], 0, 0.0, 0.1 + 0.05 * picks[-1])
    assert picks[0] == 2 and max(picks) == 2 and set(picks[1:]) <= {0, 1} and picks[1:].count(0) >= 17


def test_expensive_catch_up_spaces_probes():
    """A probe with a draft model costs a catch-up over the skipped tokens: with a 1 s catch-up, 0.1 s plain
    rounds and a probe_overhead of 0.02, probes come at most every 1 / (0.02 * 0.1) = 500 rounds."""
    policy = make_policy(k_max=4, probe_every=5, acceptance=[0.0] * 4, t_draft=0.3, t_verify={0: 0.1, 1: 0.2},
                         probe_overhead=0.02)
    run_round(policy, 1, 0, 0.3, 0.2, catchup_seconds=1.0)
    picks = [policy.choose(limit=10) for _ in range(1000)]
    assert [i for i, k in enumerate(picks) if k == 1] == [499, 999]


def test_probe_catch_up_is_paid_by_its_own_generation():
    """Plain rounds of earlier generations do not pay for a probe: with a 1 s catch-up, 0.1 s rounds and a
    probe_overhead of 0.02 a probe needs 500 plain rounds in the same generation, so generations of 100 rounds
    never probe."""
    policy = make_policy(k_max=4, probe_every=5, acceptance=[0.0] * 4, t_draft=0.3, t_verify={0: 0.1, 1: 0.2},
                         probe_overhead=0.02)
    run_round(policy, 1, 0, 0.3, 0.2, catchup_seconds=1.0, catchup_tokens=100)
    picks = []
    for _ in range(10):
        policy.gate.new_generation()
        picks += [policy.choose(limit=100, pending=100) for _ in range(100)]
    assert set(picks) == {0}
    policy.gate.new_generation()
    long = [policy.choose(limit=1000, pending=100) for _ in range(600)]
    assert [i for i, k in enumerate(long) if k == 1] == [499]
    k_policy = CostAwareK(k_max=4)  # every source's budget starts over with the generation
    sub = k_policy.for_source("model")
    sub.costs.t_draft, sub.costs.t_catchup = 0.3, 1.0
    sub.gate._gen_off_rounds = 400
    k_policy.start()
    assert sub.gate._gen_off_rounds == 0


def test_catch_up_must_pay_for_itself():
    """Drafting saves 0.05 s a token here; a draft 100 tokens behind at 0.01 s a catch-up token costs 1 s:
    worth it for 30 remaining tokens only when less than 1.5 s of catch-up is pending. A round refused for its
    catch-up does not count towards a probe."""
    # measured: k drafts cost 0.1 + 0.0125 k; 4 drafts: (0.1 + 0.15) / 5 = 0.05 s a token
    policy = make_policy(k_max=4, acceptance=[1.0] * 4, t_draft=0.025,
                         t_verify={k: 0.1 + 0.0125 * k for k in range(5)})
    assert policy.seconds_per_token(4) == pytest.approx(0.05)
    run_round(policy, 4, 4, 0.1, 0.15, catchup_seconds=2.0, catchup_tokens=200)
    assert policy.costs.t_catchup_token == pytest.approx(0.01)
    assert policy.choose(limit=30, pending=100) == 4
    assert [policy.choose(limit=30, pending=160) for _ in range(5)] == [0] * 5 and policy.gate._off_rounds == 0
    assert policy.choose(limit=30, pending=0) == 4


def test_free_drafter_is_priced_free_until_measured():
    """A source whose draft cost cannot be timed beforehand (n-gram: free) is priced as free once the verify
    costs are known: it drafts as far as the measured costs allow (one past the largest measured k) and
    learns its cost from that round; it does not draft where even free drafts cannot pay. Neither gets a
    filler round: the verify costs are known."""
    policy = CostAwareK(k_max=6)
    policy.target.t_verify.update({0: 0.1, 1: 0.12, 4: 0.13})
    ngram = policy.for_source("ngram")
    assert ngram.costs.t_draft is None and policy.choose(view(50, "ngram")) == Plan(5)
    assert policy.choose(view(3, "ngram")) == Plan(3)
    policy.observe(report(3, 3, 0.125, draft_seconds=0.003))
    assert ngram.costs.t_draft == pytest.approx(0.001)
    hopeless = CostAwareK(k_max=6)
    hopeless.target.t_verify.update({0: 0.1, 1: 0.3})
    hopeless.for_source("ngram").acceptance.rates = [0.1] * 6
    assert hopeless.choose(view(50, "ngram")) == Plan(0)


def test_catch_up_estimated_from_the_target_prefill():
    """Before the draft has caught up once, its catch-up is estimated as the target's prefill cost per token
    scaled by the draft/target step ratio: 13 ms x 0.2 = 2.6 ms a token. The prefill's cost is learnt from a first
    round's pass, which fed the prompt (and that round's drafts): 100 tokens in 1.3 s. Drafting saves 0.056 s a
    token here, 1.68 s over 30 tokens: worth 500 pending tokens (1.3 s), not 700 (1.82 s)."""
    policy = CostAwareK(k_max=4)
    for seconds, fed in ((1.3, 100), (5.0, 10)):  # 10 tokens: too few to say anything per token, ignored
        policy.start()
        assert policy.choose(view(50)) == Plan(0)  # nothing measured yet: plain
        policy.observe(report(0, 0, seconds, first=True, fed=fed))
    assert policy.target.t_prefill_token == pytest.approx(0.013)
    assert policy.target.t_verify == {}  # a first round's pass is no verify pass
    model = policy.for_source("model")
    model.acceptance.rates = [0.9] * 4
    policy.target.t_verify.update({0: 0.1, 4: 0.1})
    assert model.costs.catchup_token_cost() is None  # the draft's step cost is not known yet
    model.costs.observe_draft_step(0.02)
    assert model.costs.catchup_token_cost() == pytest.approx(0.0026)
    assert model.choose(limit=30, pending=500) == 4
    assert model.choose(limit=30, pending=700) == 0
    model.observe(4, 4, 0.08, catchup_seconds=0.1, catchup_tokens=100)  # measured: replaces the estimate
    assert model.costs.catchup_token_cost() == pytest.approx(0.001) and model.choose(limit=30, pending=700) == 4


def test_update_only_reached_positions():
    policy = make_policy(k_max=4, prior=0.5, decay=0.5)
    run_round(policy, 4, 1, 0.4, 1.0)  # position 0 accepted, position 1 rejected, 2-3 never reached
    assert policy.acceptance.rates == [0.75, 0.25, 0.5, 0.5]
    assert policy.costs.t_draft == pytest.approx(0.1) and policy.costs.target.t_verify == {4: 1.0}
    with pytest.raises(ValueError):
        CostAwareK(k_max=0)
    run_round(policy, 2, 2, 0.2, 1.0)  # k = 2, both accepted: positions 2-3 unobserved, drift towards the one before
    assert policy.acceptance.rates[:2] == [0.875, 0.625]
    assert policy.acceptance.rates[2] == pytest.approx(0.5 + 0.05 * (0.625 - 0.5))


def test_a_round_without_drafts_teaches_only_the_catch_up():
    """A round in which the source drafted nothing (its proposer had no draft) learns its catch-up and nothing
    else: no draft cost, no acceptance, no judgement, and a probe stays a probe until it drafts."""
    policy = make_policy(k_max=4, probe_every=1, acceptance=[0.0] * 4, t_draft=1.0, t_verify={0: 0.1, 4: 0.1})
    assert policy.choose(limit=10) == 1 and policy.gate.probing
    policy.observe(0, 0, 0.0, catchup_seconds=0.5, catchup_tokens=10, round_seconds=5.0, plain_tokens=1)
    assert policy.costs.t_catchup == 0.5 and policy.costs.t_catchup_token == pytest.approx(0.05)
    assert policy.costs.t_draft == 1.0 and policy.acceptance.rates == [0.0] * 4
    assert policy.gate.probing and policy.gate._judged == 0
    policy.observe(1, 1, 0.01, round_seconds=5.0)  # the probe's round: its cost replaces the estimate
    assert policy.costs.t_draft == pytest.approx(0.01) and not policy.gate.probing and policy.gate._judged == 0


def test_deeper_positions_get_tried_again():
    """A bad early estimate at position 4 must not cap k forever: while k = 3 keeps being fully accepted,
    position 4's estimate drifts up until k = 4 and beyond are tried."""
    policy = make_policy(k_max=6, acceptance=[0.9, 0.9, 0.9, 0.0, 0.0, 0.0], t_draft=0.02, t_verify={0: 1.0, 3: 1.0})
    assert policy.choose(limit=100) == 3
    picks = []
    for _ in range(100):
        k = policy.choose(limit=100)
        picks.append(k)
        run_round(policy, k, k, 0.02 * k, 1.0)  # every draft accepted
    assert max(picks) == 6


def test_a_thin_predicted_gain_is_not_enough():
    """Speculation must be predicted to save at least `margin` (5%) of plain decoding's cost per token: a 3%
    predicted gain is within the noise of the measurements it comes from, so it decodes plainly."""
    policy = make_policy(k_max=1, acceptance=[0.9], t_verify={0: 0.1, 1: 0.1})
    policy.costs.t_draft = 1.9 * 0.97 * 0.1 - 0.1  # k = 1: 1.9 tokens for (t_draft + 0.1) s, 0.97 of plain's cost
    assert policy.seconds_per_token(1) == pytest.approx(0.097)
    assert policy.choose(limit=50) == 0
    policy.costs.t_draft = 1.9 * 0.90 * 0.1 - 0.1  # a 10% gain: draft
    assert policy.choose(limit=50) == 1
    policy.gate.margin = 0.0
    policy.costs.t_draft = 1.9 * 0.97 * 0.1 - 0.1
    assert policy.choose(limit=50) == 1


def drafting_policy() -> SourcePolicy:
    """Estimates say k = 4 saves 40%: 0.9 acceptance, free drafts, verify flat at plain's 0.1 s."""
    return make_policy(k_max=4, probe_every=5, acceptance=[0.9] * 4, t_draft=0.0, t_verify={0: 0.1, 4: 0.1})


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
            policy.observe(k, k, 0.0, round_seconds=0.6 if k == 4 else 0.1, plain_tokens=k + 1)
    assert picks[:4] == [4] * 4 and picks[4:13] == [0] * 9 and picks[13] == 1  # a probe after 10 rounds
    assert picks[14:18] == [4] * 4 and picks[18] == 0  # the probe's k = 1 round looked fine: judged again
    assert policy.gate.benched and policy.gate._interval >= 20


def test_a_draft_models_verdict_is_forgotten_with_each_generation():
    """A draft model benched in one generation drafts again in the next as its estimates admit (whether it pays
    depends on the text); a free lookup's bench and backed-off probes hold across generations (its probes cost no
    catch-up)."""
    from verispec.decoding.policies.cost_aware import CostAwareK
    from verispec.names.drafters import Source

    policy = CostAwareK(k_max=4)
    model, tree, lookup = (policy.for_source(s) for s in (Source.MODEL, Source.TREE, Source.SUFFIX_SHORT))
    for source in (model, tree, lookup):
        source.gate.benched, source.gate._interval, source.gate._saving = True, 64, -1.0
    policy.start()
    for source in (model, tree):
        assert not source.gate.benched and source.gate._saving is None
        assert source.gate._interval == source.gate.probe_every
    assert lookup.gate.benched and lookup.gate._interval == 64 and lookup.gate._saving == -1.0


def test_one_bad_round_in_a_saving_spell_does_not_bench():
    """A spell that saves on the whole (0.3 s for 5 tokens; now and then a rejected round costs 0.3 s for 1
    token) keeps drafting: it is the running mean that is judged, not a round."""
    policy = drafting_policy()
    picks = []
    for i in range(40):
        k = policy.choose(limit=100)
        picks.append(k)
        accepted = 0 if i % 5 == 3 else k
        policy.observe(k, accepted, 0.0, round_seconds=0.3, plain_tokens=accepted + 1)
    assert set(picks) == {4} and not policy.gate.benched


def test_saving_judged_against_plain_passes_not_tokens():
    """A round's saving counts the passes plain decoding would have made for its tokens (plain_tokens; a report's
    is accepted + 1). A first round is not judged at all: its pass fed the prompt too, which plain decoding pays
    as well (its first pass gives the first token), so its time says nothing of what drafting saves."""
    policy = drafting_policy()
    policy.gate.judge_after = 1
    policy.observe(4, 4, 0.0, round_seconds=0.45, plain_tokens=4)  # 4 passes: 0.4 s < 0.45 s, a loss
    assert policy.gate.benched
    policy = drafting_policy()
    policy.gate.judge_after = 1
    policy.observe(4, 4, 0.0, round_seconds=0.45, plain_tokens=5)
    assert not policy.gate.benched
    k_policy = CostAwareK(k_max=4)
    k_policy.target.t_verify.update({0: 0.1, 4: 0.1})
    model = k_policy.for_source("model")
    model.costs.t_draft, model.acceptance.rates, model.gate.judge_after = 0.0, [0.9] * 4, 1
    assert k_policy.choose(view(50)) == Plan(4)
    first = report(4, 4, 5.0, first=True, fed=len(PROMPT) + 4)  # the prompt's pass: 5 s for 5 tokens
    assert first.plain_tokens == 5
    k_policy.observe(first)
    assert not model.gate.benched and k_policy.target.t_verify == {0: 0.1, 4: 0.1}
    assert k_policy.choose(view(50)) == Plan(4)
    k_policy.observe(report(4, 4, 0.55))  # the same round, not a first: 0.55 s for 5 passes' 0.5 s, a loss
    assert model.gate.benched


# -- the KPolicy over sources --------------------------------------------------------------------------


@pytest.mark.parametrize("t_verify_2, step, drafts", [(0.15, 0.05, False), (0.1, 0.01, True)],
                         ids=["verify-grows", "verify-flat"])
def test_fresh_policy_learns_costs_before_drafting(t_verify_2, step, drafts):
    """A fresh policy decodes plainly first (its first round, the prompt's pass, measures the prefill; the next one
    plain decoding), verifies one free guess from prompt lookup (a 2-token pass: the k = 1 cost, which teaches the
    source nothing), then times one draft step, and only then decides. A 2-token pass 1.5x plain and a draft step
    half of plain: (0.05 + 0.15) / 1.6 > 0.1 a token, so it never drafts. Flat verify costs and a step 0.1 of
    plain: it drafts."""
    policy, timer = CostAwareK(k_max=8), StepTimer(step)
    assert policy.choose(view(50, timer=timer)) == Plan(0) and timer.calls == 0
    policy.observe(report(0, 0, 0.32, first=True, fed=32))
    assert policy.target.t_prefill_token == pytest.approx(0.01) and not policy.target.t_verify
    assert policy.choose(view(50, timer=timer)) == Plan(0) and timer.calls == 0
    policy.observe(report(0, 0, 0.1))
    plan = policy.choose(view(50, timer=timer))
    assert plan.k == 1 and plan.draft.tokens.tolist() == [NgramIndex(GUESS_NGRAM).guess(PROMPT)] and plan.draft.probs is None
    assert timer.calls == 0
    policy.observe(report(1, 1, t_verify_2, own_draft=True))
    model = policy.by_source["model"]
    assert policy.target.t_verify == {0: 0.1, 1: t_verify_2}
    assert model.costs.t_draft is None and model.acceptance.rates == [0.6] * 8  # the guess is not the source's
    plan = policy.choose(view(50, timer=timer))
    assert timer.calls == 1 and model.costs.t_draft == step
    assert plan.draft is None and (plan.k > 0) == drafts
    assert policy.choose(view(0, timer=timer)) == Plan(0) and timer.calls == 1


def test_draft_step_timed_only_when_it_can_be():
    """No step to time (nothing pending to time it on): the source stays unpriced, and with verify costs known
    it is priced as free; no round with limit 0 times a step."""
    policy = CostAwareK(k_max=4)
    policy.target.t_verify.update({0: 0.1, 1: 0.1})
    idle = StepTimer(0.5)
    assert policy.choose(view(0, timer=idle)) == Plan(0) and idle.calls == 0
    nothing = StepTimer(None)
    assert policy.choose(view(10, timer=nothing)) == Plan(2) and nothing.calls == 1
    assert policy.by_source["model"].costs.t_draft is None


def test_catch_up_is_not_judged_as_a_round_cost():
    """A round's judged time excludes its catch-up, paid once: drafting rounds that save, after a catch-up longer
    than the round, do not bench the source; the same wall time without a catch-up in it does."""
    policy = CostAwareK(k_max=4)
    policy.target.t_verify.update({0: 0.1, 4: 0.1})
    model = policy.for_source("model")
    model.costs.t_draft, model.acceptance.rates, model.gate.judge_after = 0.0, [1.0] * 4, 1
    for _ in range(3):
        assert policy.choose(view(50)) == Plan(4)
        policy.observe(report(4, 4, 0.1, draft_seconds=0.01, catchup_seconds=5.0, catchup_tokens=100))
    assert not model.gate.benched and model.costs.t_catchup == 5.0
    assert policy.choose(view(50)) == Plan(4)
    policy.observe(report(4, 4, 0.1, draft_seconds=0.01, seconds=5.11))
    assert model.gate.benched


def test_sources_have_their_own_policies():
    policy = CostAwareK(k_max=4)
    ngram, model = policy.for_source("ngram"), policy.for_source("model")
    assert policy.for_source("ngram") is ngram and ngram is not model and set(policy.by_source) == {"ngram", "model"}
    run_round(ngram, 4, 4, 0.0, 0.2)
    run_round(model, 4, 0, 4 * 0.5, 0.2)
    assert policy.target.t_verify == {4: 0.2} and model.costs.target is policy.target is ngram.costs.target
    assert ngram.acceptance.rates[0] > ngram.acceptance.prior > model.acceptance.rates[0]
    assert ngram.costs.t_draft == 0.0 and model.costs.t_draft == 0.5


def test_model_source_switches_off_while_ngram_drafts_go_on():
    """Hybrid rounds where n-gram drafts are free and accepted, model drafts cost 0.3 of a verify pass and are
    rejected. The model's policy falls to k = 0; the n-gram one drafts on."""
    policy = CostAwareK(k_max=4)
    policy.target.observe_verify(1, 0.1)
    for _ in range(30):
        ngram = policy.for_source("ngram")
        k = ngram.choose(limit=100)
        run_round(ngram, k, k, 0.0, 0.1 + 0.02 * k)
        model = policy.for_source("model")
        k = model.choose(limit=100)
        run_round(model, k, 0, 0.03 * k, 0.1 + 0.02 * k)
    assert policy.for_source("ngram").choose(limit=100) == 4
    assert policy.for_source("model").choose(limit=100) == 0


# -- with the engine -----------------------------------------------------------------------------------


def test_draft_model_time_step_is_part_of_its_catch_up(target):
    """A timed draft step (catch_up of one token) feeds a committed token the draft has not seen: the drafts
    that follow are those of a draft that never timed a step."""
    from verispec.backends import HFModel
    from verispec.core.sampling import SamplingParams
    from verispec.proposers import DraftModel

    drafts = []
    for timed in (False, True):
        proposer = DraftModel(HFModel(tiny_qwen2(3)), 64)
        seq = TokenSequence(list(range(1, 11)), 40, torch.device("cpu"))
        proposer.start(0, seq, SamplingParams(), torch.Generator())
        if timed:
            assert proposer.catch_up(0, seq, 1) == 1 and proposer.catch_up(0, seq, 1) == 1
            assert proposer.model.lengths[0] == 2 and proposer.pending(0, seq) == 7
        drafts.append(proposer.propose([(0, seq, 4, None)])[0].tokens.tolist())
    assert drafts[0] == drafts[1]
    short = TokenSequence([1], 40, torch.device("cpu"))
    proposer.start(0, short, SamplingParams(), torch.Generator())
    assert proposer.catch_up(0, short, 1) == 0 and proposer.model.lengths[0] == 0  # nothing to spare


def test_draft_model_reports_pending_catch_up(target):
    from verispec.backends import HFModel
    from verispec.core.sampling import SamplingParams
    from verispec.proposers import DraftModel

    proposer = DraftModel(HFModel(tiny_qwen2(3)), 64)
    seq = TokenSequence(list(range(1, 11)), 40, torch.device("cpu"))
    proposer.start(0, seq, SamplingParams(), torch.Generator())
    assert proposer.pending(0, seq) == 9  # the prompt but its last token, fed with the first draft step
    assert proposer.catch_up(0, seq) == 9 and proposer.pending(0, seq) == 0 and proposer.model.lengths[0] == 9
    proposer.propose([(0, seq, 2, None)])
    proposer.observe(0, seq, 2, 0)
    seq.extend([5], torch.tensor([5]))
    assert proposer.pending(0, seq) == 0


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

    def choose(view):
        plan = real_choose(view)
        chosen.append((plan.k, view.limit))
        return plan

    eng.k_policy.choose = choose
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
    assert eng.k_policy.by_source["ngram"].choose(limit=100) >= 4 or out.stats.acceptance_rate < 0.5


@pytest.mark.parametrize("k", ["auto"])
def test_auto_with_draft_model_is_exact(target, k):
    draft = perturbed(target, seed=2, noise=0.05)
    plain = make_engine(target).generate([4, 2], max_new_tokens=50).token_ids
    assert make_engine(target, draft, k=k).generate([4, 2], max_new_tokens=50).token_ids == plain


def test_hybrid_auto_is_exact(target):
    prompt = [5, 6, 7, 8, 9, 10] * 8
    plain = make_engine(target).generate(prompt, max_new_tokens=80).token_ids
    eng = make_engine(target, tiny_qwen2(99), k="auto", drafter="hybrid")
    assert eng.generate(prompt, max_new_tokens=80).token_ids == plain
    assert set(eng.k_policy.by_source) <= {"ngram", "model"} and eng.k_policy.by_source


def test_engine_learns_costs_before_the_draft_runs(target):
    """A fresh engine with k = auto: the first round's pass over the prompt (plain: nothing is measured yet; the
    first token), a plain pass, a filler pass (2 tokens) on the target before the draft model runs at all; its
    first pass is a single timed step. The output is plain decoding's."""
    from verispec.backends import HFModel
    from verispec.decoding.engine import SpeculativeEngine
    from verispec.proposers import DraftModel

    log = []

    class Logged(HFModel):
        def __init__(self, model, name):
            super().__init__(model)
            self.name = name

        def forward_rows(self, slots, feeds, last_only=False, logits_for=None):
            log.append((self.name, sum(f.numel() for f in feeds)))
            return super().forward_rows(slots, feeds, last_only, logits_for)

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = make_engine(target).generate(prompt, max_new_tokens=30).token_ids
    t = Logged(target, "T")
    draft = DraftModel(Logged(perturbed(target, seed=2, noise=0.05), "D"), t.vocab_size)
    eng = SpeculativeEngine(t, draft, k="auto", auto_policy=CostAwareK())
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


def test_engine_benches_a_draft_with_costs_the_estimates_miss(target):
    """A target pass that takes 20 ms, a draft that agrees with it at ~1 ms a step, but whose rollback after
    every round costs 0.3 s, more than a round of 9 tokens saves: the estimates (draft steps, verify passes)
    keep predicting a win, the measured rounds bench the draft after judge_after rounds. Output: plain's."""
    import time

    from verispec.backends import HFModel
    from verispec.decoding.engine import SpeculativeEngine
    from verispec.proposers import DraftModel

    class SlowTarget(HFModel):
        def forward_rows(self, slots, feeds, last_only=False, logits_for=None):
            time.sleep(0.02)
            return super().forward_rows(slots, feeds, last_only, logits_for)

    class SlowRollback(DraftModel):
        def observe(self, slot, seq, drafted, accepted):
            time.sleep(0.3)
            super().observe(slot, seq, drafted, accepted)

    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    plain = make_engine(target).generate(prompt, max_new_tokens=50).token_ids
    eng = SpeculativeEngine(SlowTarget(target), SlowRollback(HFModel(target), target.config.vocab_size),
                            k="auto", auto_policy=CostAwareK())
    rounds = []  # (k planned, the gate benched after the round)
    probes = []  # the rounds that were probes (k = 1 while the estimates said no: measured, not judged)
    real = eng.k_policy.observe

    def logged(report):
        source = eng.k_policy.by_source.get("model")
        probes.append(source is not None and source.gate.probing)
        real(report)
        rounds.append((report.k, eng.k_policy.by_source["model"].gate.benched))

    eng.k_policy.observe = logged
    assert eng.generate(prompt, max_new_tokens=50).token_ids == plain
    gate = eng.k_policy.by_source["model"].gate
    benched_at = next(i for i, (_, benched) in enumerate(rounds) if benched)
    # benched by the rounds it measured: the filler and judge_after judged ones, however many tokens each drafted
    # (a probe, which a slow spell on a loaded machine can bring before them, is not judged)
    judged = [k > 0 and not probe for (k, _), probe in zip(rounds[: benched_at + 1], probes)]
    assert sum(judged) == 1 + gate.judge_after, (rounds, probes)
    # and once benched, plain decoding until a probe (its interval is longer than the rest of this generation
    # when drafting goes well, not when slow steps on a loaded machine make the drafts shorter)
    after = rounds[benched_at + 1 :]
    quiet = next((i for i, (k, _) in enumerate(after) if k > 0), len(after))
    assert quiet >= min(len(after), gate.probe_every) and all(benched for _, benched in after[:quiet])
