"""Cost-aware adaptive k: each round, draft the number of tokens that maximises expected tokens per second,
from the acceptance learned per draft position and the measured costs of drafting and verifying.

With a_i = P(draft i accepted | the drafts before it accepted), a round of k drafts emits on average
E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i tokens and costs T(k) = k * t_draft + t_verify(k). k = 0 is plain
decoding (E = 1, T = t_verify(0)): the baseline every k is weighed against. Only speed depends on these
choices, never the output: every draft is verified exactly.

The parts, each usable on its own with plain numbers:

    TargetCosts         the target's measured costs: a verify pass per k, the prefill per token
    CostModel           one draft source's costs on top of them: draft step, catch-up, seconds per token for k
    AcceptanceEstimate  a_i per draft position, and E(k)
    ProbeGate           whether speculation may draft, when it probes while off, when a source is benched
    SourcePolicy        one source's k, composing a CostModel, an AcceptanceEstimate and a ProbeGate
    CostAwareK          the `KPolicy`: a SourcePolicy per draft source, and how a fresh policy learns its costs;
                        rounds whose pass several rows share are planned from the same state (SharedPass)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from weakref import WeakKeyDictionary

from verispec.core.draft import Draft
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.decoding.policies.base import Plan, RoundReport, RoundView, ema
from verispec.decoding.policies.shared_pass import SharedPass
from verispec.names.drafters import DRAFT_MODEL_SOURCES, Source
from verispec.names.k import K_MAX
from verispec.proposers.ngram import NgramIndex

GUESS_NGRAM = 4  # the longest suffix a filler guess looks up


def _check_decay(decay: float) -> None:
    if not 0.0 < decay < 1.0:
        raise ValueError(f"decay must be in (0, 1), got {decay}")


# -- the cost model ------------------------------------------------------------------------------------


@dataclass
class TargetCosts:
    """What the target's passes cost, as measured; shared by the policies of every draft source.

    The verify cost is measured per k. It is nearly flat in k on some backends and grows, not smoothly, on
    others, so no curve through a few measurements predicts the rest. An unmeasured k is assumed to cost what
    the nearest measured smaller k costs: optimistic, so every k that could pay is tried once, measured and
    from then on judged by its own cost. The optimism is trusted one k at a time: only k up to `frontier`, one
    past the largest measured k, are candidates, so a k is tried only when the acceptance learned at the k
    below it says one more draft pays. Pricing every unmeasured k at a short pass's cost would have a fresh
    policy draft k_max at the prior acceptance and pay for the longest pass where drafts turn out poor.
    """

    decay: float = 0.85  # weight of the past in the running means
    t_verify: dict[int, float] = field(default_factory=dict)  # k -> seconds of a pass over k + 1 tokens
    t_prefill_token: float | None = None  # seconds per prompt token of the prefill (None: not measured)

    def __post_init__(self) -> None:
        _check_decay(self.decay)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """A target pass fed `tokens` tokens (k + 1 for a verify pass over k drafts) in `seconds`."""
        self.t_verify[tokens - 1] = ema(self.t_verify.get(tokens - 1), seconds, self.decay)

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """The prefill fed `tokens` prompt tokens in `seconds` (worth learning from >= 16 tokens: fewer are
        dominated by the pass's fixed cost)."""
        if tokens >= 16:
            self.t_prefill_token = ema(self.t_prefill_token, seconds / tokens, self.decay)

    @property
    def knows_plain(self) -> bool:
        """Plain decoding's cost, t_verify(0), has been measured."""
        return 0 in self.t_verify

    def frontier(self) -> int:
        """The largest k worth trying: one past the largest measured k (at least one k must be measured)."""
        return max(self.t_verify) + 1

    def verify(self, k: int) -> float:
        """Seconds of a verify pass over k drafts: measured, else what the nearest measured smaller k costs (else
        the cheapest measured larger k). Never dearer than a measured larger k: a pass over more tokens cannot
        be cheaper, so a timing spike in one measurement (k = 0 is measured rarely) must not tilt every
        decision. At least one k must be measured."""
        larger = [t for m, t in self.t_verify.items() if m > k]
        if k in self.t_verify:
            value = self.t_verify[k]
        else:
            lower = [m for m in self.t_verify if m < k]
            value = self.t_verify[max(lower)] if lower else min(larger)
        return min(value, *larger) if larger else value


@dataclass
class CostModel:
    """One draft source's costs, on top of the target's (shared with the other sources).

    A round of k drafts costs k * t_draft + t_verify(k). A source whose draft step has not been measured (a free
    drafter such as n-gram lookup, whose step cannot be timed on its own) is priced as free until its first
    draft measures it.

    A draft model that has fallen behind (a new prompt, or rounds decoded without it) must first catch up on the
    tokens it has not seen: a one-off prefill that can cost more than many rounds save. Its cost per token is
    measured at each catch-up; until one is, it is estimated from the target's prefill cost per token scaled by
    the draft/target one-token cost ratio, a rough guess (a draft's batched pass may gain less from batching than
    the target's) that the first measured catch-up replaces.
    """

    target: TargetCosts
    decay: float = 0.85  # weight of the past in the running means
    t_draft: float | None = None  # seconds per draft step (None: not measured yet)
    t_catchup: float = 0.0  # seconds the draft needed last time to catch up on skipped tokens
    t_catchup_token: float | None = None  # seconds per token of catch-up (None: not measured yet)

    def __post_init__(self) -> None:
        _check_decay(self.decay)

    def observe_draft_step(self, seconds: float) -> None:
        """One draft step, timed on its own, took `seconds`."""
        self.t_draft = seconds

    def observe_draft(self, steps: int, seconds: float, replace: bool = False) -> None:
        """`steps` draft steps took `seconds`. `replace`: the measurement replaces the estimate instead of joining
        its running mean (see `SourcePolicy.observe`)."""
        per_step = seconds / steps
        self.t_draft = per_step if replace else ema(self.t_draft, per_step, self.decay)

    def observe_catchup(self, seconds: float, tokens: int) -> None:
        """The draft caught up on `tokens` tokens in `seconds` (0 seconds: it had nothing to catch up on)."""
        if seconds > 0.0:
            self.t_catchup = seconds
            if tokens > 0:
                self.t_catchup_token = ema(self.t_catchup_token, seconds / tokens, self.decay)

    def catchup_token_cost(self) -> float | None:
        """Seconds per token of catch-up: measured, else the target's prefill cost per token scaled by the
        draft/target one-token cost ratio, else unknown."""
        if self.t_catchup_token is not None:
            return self.t_catchup_token
        target = self.target
        if target.t_prefill_token is None or self.t_draft is None or not target.knows_plain:
            return None
        return target.t_prefill_token * self.t_draft / target.verify(0)

    def catchup_cost(self, pending: int) -> float | None:
        """Estimated seconds to catch up on `pending` tokens (None: nothing pending, or the cost is unknown)."""
        per_token = self.catchup_token_cost()
        return pending * per_token if pending and per_token is not None else None

    def seconds_per_token(self, k: int, tokens: float) -> float:
        """Seconds per emitted token of a round of k drafts that emits `tokens` tokens on average (E(k))."""
        t_draft = 0.0 if self.t_draft is None else self.t_draft  # not measured yet: priced as free
        return (k * t_draft + self.target.verify(k)) / tokens


# -- the acceptance estimate ---------------------------------------------------------------------------


@dataclass
class AcceptanceEstimate:
    """a_i, i = 1 .. k_max: the chance that draft i is accepted when the drafts before it were (`rates[i - 1]`), as
    a running mean over the rounds that reached position i; and the expected tokens per round, E(k).

    A position beyond the k drafted is not observed while k stays below it, so a bad early estimate there would
    stick and cap k for good. Each round, every unobserved position's estimate moves `explore` of the way
    towards the one before it, so that deeper drafts get tried again.
    """

    k_max: int = K_MAX
    decay: float = 0.85  # weight of the past in the running means
    prior: float = 0.6  # every position's estimate before any observation
    explore: float = 0.05  # per round, how far an unobserved position's estimate moves towards the one before
    rates: list[float] = field(default_factory=list)  # a_i (empty: all `prior`)

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        _check_decay(self.decay)
        if not self.rates:
            self.rates = [self.prior] * self.k_max
        if len(self.rates) != self.k_max:
            raise ValueError(f"rates must hold k_max = {self.k_max} values, got {len(self.rates)}")

    def expected_tokens(self, k: int) -> float:
        """E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i: the tokens a round of k drafts emits on average, the one the
        target adds (recovered or bonus) included."""
        total, run = 1.0, 1.0
        for a in self.rates[:k]:
            run *= a
            total += run
        return total

    def observe(self, drafted: int, accepted: int) -> None:
        """A round verified `drafted` drafts and accepted the first `accepted` of them."""
        if drafted < 1:
            return
        for i in range(min(accepted + 1, drafted)):  # the positions the round reached
            self.rates[i] = ema(self.rates[i], 1.0 if i < accepted else 0.0, self.decay)
        for i in range(drafted, self.k_max):  # the positions it did not reach drift
            self.rates[i] += self.explore * (self.rates[i - 1] - self.rates[i])


# -- the probe gate ------------------------------------------------------------------------------------


@dataclass
class ProbeGate:
    """Whether a source may draft, and when it probes while it may not.

    Every input to the choice of k is a noisy measurement, and acceptance is learned across prompts, so a
    predicted gain of a few percent is as often a loss. Two guards keep speculation from losing to plain
    decoding where the difference cannot be told from noise:

    - a draft must be predicted to save at least `margin` of plain decoding's cost per token (`admits`);
    - once drafting, each round's realised saving is measured (`observe_drafting`): plain decoding's cost of
      the tokens the round emitted less the round's wall time, which includes costs the estimates do not all
      see (rolling both caches back). When the running mean of the savings is negative after `judge_after`
      rounds, the source is benched: it decodes plainly until its next probe, whatever the estimates say, and
      its probes back off as failed ones do.

    While a source does not draft, it probes now and then with k = 1 so that it can switch back on
    (`off_round`): after `probe_every` plain rounds, the interval doubling (up to `max_probe_every`) after
    each failed probe. A probe makes a draft model catch up on everything it skipped, so a probe also waits
    until the generation it happens in has decoded enough plain rounds that the catch-up costs at most
    `probe_overhead` of them: each generation pays for its own probes, never with the plain rounds of the
    prompts before it (`new_generation` starts the count over, and may forget the verdict: `fresh`).
    """

    probe_every: int = 16  # plain rounds before the first probe
    max_probe_every: int = 256
    probe_overhead: float = 0.1  # a probe's catch-up's share of the generation's plain rounds, at most
    margin: float = 0.05  # a draft must be predicted to save this share of plain decoding's cost per token
    judge_after: int = 4  # drafting rounds before their measured saving can bench the source
    decay: float = 0.85  # weight of the past in the running mean of the savings
    probing: bool = False  # the round just chosen is a probe
    benched: bool = False  # drafting measured a loss: plain decoding until the next probe
    _off_rounds: int = 0  # plain rounds since the last probe, across generations (spaces the probes)
    _gen_off_rounds: int = 0  # plain rounds in this generation since its last probe (pays for a probe's catch-up)
    _interval: int = 0  # plain rounds before the next probe (probe_every, doubling while probes fail)
    _saving: float | None = None  # running mean of the seconds each drafting round saved (None: none yet)
    _judged: int = 0  # drafting rounds in _saving
    _bench_interval: int = 0  # the probe interval after a benching (doubles with each, reset by a saving spell)

    def __post_init__(self) -> None:
        _check_decay(self.decay)
        self._interval = self._bench_interval = self.probe_every

    def new_generation(self, fresh: bool = False) -> None:
        """A generation starts: a probe's catch-up is paid by its own plain rounds from here on. `fresh`: the verdict
        before is forgotten (not benched, a probe after probe_every), not how long the next bench lasts."""
        self._gen_off_rounds = 0
        if fresh:
            self.benched, self._saving, self._judged = False, None, 0
            self._interval, self._off_rounds = self.probe_every, 0

    def admits(self, seconds_per_token: float, plain_seconds: float) -> bool:
        """A draft predicted to cost `seconds_per_token` against plain decoding's `plain_seconds` may run."""
        return not self.benched and seconds_per_token <= (1.0 - self.margin) * plain_seconds

    def off_round(self, catchup_seconds: float, plain_seconds: float) -> bool:
        """The source will not draft this round (plain decoding costs `plain_seconds` a round; a probe would
        first make the draft catch up, for `catchup_seconds`). True: probe instead, with k = 1."""
        self._off_rounds += 1
        self._gen_off_rounds += 1
        affordable = catchup_seconds / (self.probe_overhead * plain_seconds)
        if self._off_rounds < self._interval or self._gen_off_rounds < affordable:
            return False
        self._off_rounds = self._gen_off_rounds = 0
        self._interval = min(2 * self._interval, self.max_probe_every)
        self.probing = True
        self.benched, self._saving, self._judged = False, None, 0  # the probe judges afresh
        return True

    def on_round(self) -> None:
        """The source drafts this round: should it stop, it probes after the shortest interval again."""
        self._off_rounds = 0
        self._interval = self.probe_every

    def observe_drafting(self, saved: float | None) -> None:
        """A drafting round ran and saved `saved` seconds over plain decoding (negative: lost; None: not
        measured). A probe's round is not judged: k = 1 rarely pays on its own, it measures acceptance."""
        if saved is not None and not self.probing:
            self._judge(saved)
        self.probing = False

    def _judge(self, saved: float) -> None:
        self._judged += 1
        self._saving = ema(self._saving, saved, self.decay)
        if self._judged < self.judge_after:
            return
        if self._saving >= 0.0:
            self._bench_interval = self.probe_every
        elif not self.benched:  # back off like failed probes do: a source that keeps losing is probed rarely
            self.benched = True
            self._bench_interval = min(2 * self._bench_interval, self.max_probe_every)
            self._interval, self._off_rounds = self._bench_interval, 0


# -- the policy ----------------------------------------------------------------------------------------


@dataclass
class SourcePolicy:
    """k for one draft source: of 0 .. min(limit, k_max, costs.target.frontier()), the k with the fewest
    seconds per token, when the probe gate admits it.

    A draft model that must first catch up on `pending` tokens drafts only when the time speculation saves
    over the tokens still to generate exceeds the catch-up's estimated cost; otherwise the round is plain, and
    not counted towards a probe: the estimates say drafting pays per token, so a probe has nothing to learn.
    """

    costs: CostModel
    acceptance: AcceptanceEstimate
    gate: ProbeGate = field(default_factory=ProbeGate)

    @property
    def k_max(self) -> int:
        return self.acceptance.k_max

    def seconds_per_token(self, k: int) -> float:
        return self.costs.seconds_per_token(k, self.acceptance.expected_tokens(k))

    def choose(self, limit: int, pending: int = 0) -> int:
        """k for the next round, at most min(limit, k_max); `pending`: tokens the draft must catch up on
        before it can draft (0 for drafters without a model)."""
        costs, gate = self.costs, self.gate
        top = min(limit, self.k_max)
        if top <= 0 or not costs.target.knows_plain:
            return 0  # plain decoding is measured first: it is the alternative every k is weighed against
        best = min(range(min(top, costs.target.frontier()) + 1), key=self.seconds_per_token)
        plain = costs.target.verify(0)
        if not gate.admits(self.seconds_per_token(best), plain):
            best = 0
        catchup = costs.catchup_cost(pending)
        if best > 0 and catchup is not None and (plain - self.seconds_per_token(best)) * limit < catchup:
            return 0  # catching the draft up costs more than speculating can win back in this generation
        if best == 0:
            probe_catchup = costs.t_catchup if catchup is None else catchup
            return 1 if gate.off_round(probe_catchup, plain) else 0
        gate.on_round()
        return best

    def observe(self, drafted: int, accepted: int, draft_seconds: float, catchup_seconds: float = 0.0,
                catchup_tokens: int = 0, round_seconds: float | None = None, plain_tokens: int | None = None) -> None:
        """After a round that verified `drafted` drafts from this source, `accepted` of them, drafted in
        `draft_seconds` after a catch-up on `catchup_tokens` tokens in `catchup_seconds`. `round_seconds`: the
        round's wall time (drafting, verifying, rollbacks), catch-up excluded; `plain_tokens`: the target passes
        plain decoding would have made for the round's tokens (default accepted + 1); with them the round's
        saving is judged. The target pass's own cost is the caller's to report, to the shared TargetCosts.

        A probe's draft cost replaces the old estimate outright: that one may date from a slow spell (another
        process on the cores) that switched drafting off, and averaging it away would take many rare probes."""
        costs = self.costs
        costs.observe_catchup(catchup_seconds, catchup_tokens)
        if drafted == 0:
            return
        costs.observe_draft(drafted, draft_seconds, replace=self.gate.probing)
        saved = None
        if round_seconds is not None and costs.target.knows_plain:
            passes = accepted + 1 if plain_tokens is None else plain_tokens
            saved = passes * costs.target.verify(0) - round_seconds
        self.gate.observe_drafting(saved)
        self.acceptance.observe(drafted, accepted)


class CostAwareK:
    """The cost-aware k policy behind the `KPolicy` interface: one `SourcePolicy` per draft source, all sharing
    the target's costs. A proposer that mixes sources (hybrid: n-gram drafts when they match, the draft model
    otherwise) thus gets a policy per source that learns its own acceptance and draft cost, so the draft model
    can switch itself off while free n-gram drafts go on.

    A fresh policy knows no costs, and drafting blind is what a learning policy must not do: a model draft of
    k_max tokens and the draft's catch-up on the prompt can cost several plain tokens. So it learns the cheap
    way first. Plain rounds measure t_verify(0) (the generation's first round costs no pass at all: the prefill
    gave its token). A filler round then measures t_verify(1): it verifies one free guess from prompt lookup
    instead of a draft, exact like any deterministic draft. A source whose draft cost is still unknown after
    that (n-gram lookup: free, no step to time) is priced as free until its first draft measures it. Before a
    draft model's first draft, one draft step is timed on a token of its catch-up (`RoundView.time_draft_step`),
    and the catch-up itself is estimated from the target's prefill until one is measured (`CostModel`). Only
    then does the draft model catch up, and only when it pays.
    """

    def __init__(self, k_max: int = K_MAX) -> None:
        if k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {k_max}")
        self.k_max = k_max
        self.target = TargetCosts()
        self.by_source: dict[str, SourcePolicy] = {}
        self._policy: SourcePolicy | None = None  # the one that chose the last plan
        self.shared = SharedPass(self)  # rounds whose pass several rows share
        self._guesses: WeakKeyDictionary[TokenSequence, NgramIndex] = WeakKeyDictionary()  # a filler's lookups

    def choose_shared(self, views: list[RoundView], width: int, rows: int) -> list[Plan]:
        """The plans of the rows with k = 'auto' in a round shared by several rows (see SharedPass)."""
        return self.shared.choose(views, width, rows)

    def observe_shared(self, reports: list[RoundReport], width: int, prefill: bool) -> None:
        self.shared.observe(reports, width, prefill)

    def for_source(self, source: str) -> SourcePolicy:
        """The policy of one draft source (made on first use)."""
        if source not in self.by_source:
            self.by_source[source] = SourcePolicy(CostModel(self.target), AcceptanceEstimate(self.k_max))
        return self.by_source[source]

    def start(self) -> None:
        """A request is admitted (rows with k = auto share this policy): a draft model's source is judged afresh, its
        pay depending on the text (benched, it would wait out probes priced by catch-ups over new prompts)."""
        for source, policy in self.by_source.items():
            policy.gate.new_generation(fresh=source in DRAFT_MODEL_SOURCES)

    def choose(self, view: RoundView) -> Plan:
        policy = self._policy = self.for_source(view.source)
        if view.limit > 0 and self._wants_draft_step(policy.costs):
            step = view.time_draft_step()
            if step is not None:
                policy.costs.observe_draft_step(step)
        if view.limit > 0 and self._wants_filler(policy.costs):
            index = self._guesses.setdefault(view.seq, NgramIndex(GUESS_NGRAM))
            guess = device_tensor([index.guess(view.seq.ids)], view.seq.buffer.device)
            return Plan(1, Draft(guess, None, Source.GUESS))
        return Plan(policy.choose(view.limit, view.pending))

    def observe(self, report: RoundReport) -> None:
        """A first round's pass is the prompt's prefill (its drafts too): it measures the prefill's cost per token,
        and its saving is not judged; every other pass measures the verify cost of its width."""
        if report.first:
            self.target.observe_prefill(report.verify_seconds, report.fed)
        else:
            self.target.observe_verify(report.fed, report.verify_seconds)
        if not report.own_draft:
            round_seconds = None if report.first else report.seconds - report.catchup_seconds
            self._policy.observe(report.drafted, report.accepted, report.draft_seconds, report.catchup_seconds,
                                 report.catchup_tokens, round_seconds=round_seconds, plain_tokens=report.plain_tokens)

    @staticmethod
    def _wants_filler(costs: CostModel) -> bool:
        """Only plain decoding's verify cost is known (t_verify(1) is the cheapest next one to learn), and the
        source's draft cost is not."""
        return costs.t_draft is None and costs.target.knows_plain and len(costs.target.t_verify) < 2

    @staticmethod
    def _wants_draft_step(costs: CostModel) -> bool:
        """The source's draft cost is unknown and the verify costs it will be weighed against are known."""
        return costs.t_draft is None and costs.target.knows_plain and len(costs.target.t_verify) > 1
