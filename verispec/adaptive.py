"""Cost-aware adaptive k: each round, pick the number of draft tokens that maximises expected tokens per
second, from the recent acceptance per draft position and the measured draft and verify costs.

With a_i = P(draft i accepted | drafts before it accepted), a round of k drafts emits on average
E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i tokens and costs T(k) = k * t_draft + t_verify(k). k = 0 is plain
decoding (E = 1, T = t_verify(0)); when nothing beats it, speculation switches itself off, probing now and
then with k = 1 (less and less often while probes fail) so that it can switch back on. Only speed depends
on these choices, never the output.

The verify cost is measured per k. It is nearly flat in k for transformers on this CPU but grows, and not
smoothly, on llama.cpp (relative to one token, measured here: 1.5x for 2 tokens, 2.0x for 3, 1.6x for 4,
3.15x for 9), so no curve through a few measurements predicts the rest. An unmeasured k is assumed to cost
what the nearest measured smaller k costs: optimistic, so every k that could pay is tried once, measured and
from then on judged by its own cost. Exploration climbs one k at a time: only k up to one past the largest
measured one are candidates, so a k is tried only when the acceptance learned at the k below it says one more
draft pays (before, a fresh policy priced k = 8 at the 2-token cost and drafted 8 at the prior acceptance: on
llama.cpp a 9-token eval costs ~3.2 one-token evals, and a poorly matching first prompt paid for that
exploration, 0.82x of plain decoding in its first repeat). Plain decoding (k = 0) is measured once early
instead of being assumed to cost what a verify pass does.

A draft model that has fallen behind (a new prompt, or rounds decoded without it) must first catch up on
the tokens it has not seen, a one-off prefill that can cost seconds (the 0.5B on llama.cpp: ~10 ms per
token). The policy weighs it: drafting starts only when the time speculation saves over the tokens still
to generate exceeds the catch-up's estimated cost (pending tokens x the measured seconds per catch-up token).
A probe's catch-up is paid out of the generation it happens in: it comes only after enough plain rounds of
that same generation that it costs at most `probe_overhead` of them (the engine calls `new_generation`), so
no single prompt pays for the plain rounds of the prompts before it.

A fresh policy knows no costs, and drafting blind is what a learning policy must not do: on llama.cpp a
model draft of 8 tokens and its catch-up on the prompt cost several plain tokens. So it learns the cheap way
first: plain rounds measure t_verify(0) (the first round, whose token the prefill gave, costs no pass at
all), then a "filler" round (`filler`) measures t_verify(1): the engine verifies one free guess (prompt
lookup) instead of a draft, exact like any deterministic draft. A source whose draft cost is not known by then
(n-gram lookup: free; no step could be timed) is priced as free until its first draft measures it. Then,
before a draft model's first draft,
the engine times one draft step on a token of its catch-up (`wants_draft_cost`), and the catch-up itself is
estimated from the target's prefill (seconds per prompt token, scaled by the draft/target step cost ratio)
until one is measured. Only then does the draft model catch up, and only when it pays. On llama.cpp, where
the model draft does not pay, the learning costs about half a plain pass for the filler (less what its
guess wins) and one draft step; drafting k_max blind, twice, cost the catch-up and 16 draft steps.

Every input to that choice is a noisy measurement (one-token evals here swing +-5% from one minute to the
next) and acceptance is learned across prompts, so a predicted gain of a few percent is as often a loss. Two
guards keep speculation from losing to plain decoding where it cannot be told from noise. A draft must be
predicted to save at least `margin` of plain decoding's cost per token. And once drafting, each round's
realised saving is measured: plain decoding's cost of the tokens the round emitted minus the round's wall
time (drafting, verifying, rolling both caches back: costs the estimates do not all see; a catch-up, paid
once, is not counted). When its running (exponentially weighted) mean is negative after `judge_after`
rounds, the source is benched, decoding plainly until its next probe whatever the estimates say, and its
probes back off as failed ones do.

A proposer that mixes sources (hybrid: n-gram drafts when they match, the draft model otherwise) gets one
sub-policy per source (`for_source`): each learns its own acceptance and draft cost and they share the
measured verify costs, so the draft model can switch itself off while free n-gram drafts keep going.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.policy import Plan, RoundReport, RoundView
from verispec.proposers.base import Draft
from verispec.proposers.ngram import lookup_guess


@dataclass
class AdaptiveK:
    k_max: int = 8
    decay: float = 0.85  # weight of the past in the running estimates
    probe_every: int = 16  # rounds between k = 1 probes while speculation is off
    prior_acceptance: float = 0.6
    acceptance: list[float] = field(default_factory=list)  # a_i, i = 0 .. k_max-1
    t_draft: float | None = None  # seconds per draft forward (None: not measured yet)
    t_verify: dict[int, float] = field(default_factory=dict)  # k -> seconds of a verify pass over k+1 tokens
    explore: float = 0.05  # per round, how far an unobserved position's estimate moves towards the one before
    max_probe_every: int = 256
    probe_overhead: float = 0.02  # probes may cost at most this share of decoding time (their draft catch-up)
    t_catchup: float = 0.0  # seconds the draft needed last time to catch up on skipped tokens
    t_catchup_token: float | None = None  # seconds per token of draft catch-up (None: not measured yet)
    t_prefill_token: float | None = None  # the target's prefill, seconds per prompt token (None: not measured)
    filler: bool = False  # the round just chosen verifies a free guess, not the source's draft (learns costs)
    margin: float = 0.05  # a draft must be predicted to save this share of plain decoding's cost per token
    judge_after: int = 4  # rounds of drafting before their measured saving can bench the source
    by_source: dict[str, AdaptiveK] = field(default_factory=dict, repr=False)  # sub-policies, see for_source
    _off_rounds: int = 0  # rounds off since the last probe (across generations: spaces the probes)
    _gen_off_rounds: int = 0  # rounds off in this generation since its last probe (pays for probe catch-ups)
    _probing: bool = False  # the round just chosen is a probe
    _interval: int = 0  # rounds to the next probe (probe_every, doubling while probes fail)
    _saving: float | None = None  # running mean of the seconds each drafting round saved (None: none since probe)
    _judged: int = 0  # drafting rounds in _saving
    _benched: bool = False  # drafting measured a loss: plain decoding until the next probe
    _bench_interval: int = 0  # the probe interval after a benching (doubles with each, reset by a saving spell)
    _root: AdaptiveK | None = field(default=None, repr=False, compare=False)  # a sub-policy's parent

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if not self.acceptance:
            self.acceptance = [self.prior_acceptance] * self.k_max
        self._interval = self._bench_interval = self.probe_every

    def for_source(self, source: str | None) -> AdaptiveK:
        """This policy (source None) or the sub-policy for one draft source, sharing the verify costs."""
        if source is None:
            return self
        if source not in self.by_source:
            self.by_source[source] = AdaptiveK(
                k_max=self.k_max, decay=self.decay, probe_every=self.probe_every,
                prior_acceptance=self.prior_acceptance, t_verify=self.t_verify, explore=self.explore,
                max_probe_every=self.max_probe_every, probe_overhead=self.probe_overhead, margin=self.margin,
                judge_after=self.judge_after, _root=self)
        return self.by_source[source]

    def new_generation(self) -> None:
        """A new generation starts: probe catch-ups are budgeted against its own plain rounds from here."""
        self._gen_off_rounds = 0
        for policy in self.by_source.values():
            policy.new_generation()

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """The target's prefill fed `tokens` prompt tokens in `seconds` (worth learning from >= 16 tokens:
        fewer are dominated by the pass's fixed cost)."""
        if tokens >= 16:
            self.t_prefill_token = self._ema(self.t_prefill_token, seconds / tokens)

    def observe_verify(self, tokens: int, seconds: float) -> None:
        """A target pass fed `tokens` tokens (k + 1 for a verify pass over k drafts)."""
        self.t_verify[tokens - 1] = self._ema(self.t_verify.get(tokens - 1), seconds)

    def wants_draft_cost(self) -> bool:
        """The next draft from this source should be preceded by a timed draft step (`observe_draft_step`):
        its cost is unknown, and the verify costs it will be weighed against are known."""
        return self.t_draft is None and 0 in self.t_verify and len(self.t_verify) > 1

    def observe_draft_step(self, seconds: float) -> None:
        self.t_draft = seconds

    def catchup_token_cost(self) -> float | None:
        """Seconds per token of the draft's catch-up: measured, else the target's prefill cost per token
        scaled by the draft/target one-token cost ratio (measured here: within 5% on llama.cpp; a third of
        the real cost for the int4 transformers draft, whose batched passes gain less), else unknown."""
        if self.t_catchup_token is not None:
            return self.t_catchup_token
        prefill = (self._root or self).t_prefill_token
        if prefill is None or self.t_draft is None or 0 not in self.t_verify:
            return None
        return prefill * self.t_draft / self.verify_cost(0)

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1.0 - self.decay) * new

    def verify_cost(self, k: int) -> float:
        """Measured; an unmeasured k is assumed to cost what the nearest measured smaller k costs (optimistic:
        a pass over more tokens costs at least that, and the assumption gets k tried and then measured). Never
        dearer than a measured larger k: a pass over more tokens cannot be cheaper, so a timing spike in one
        measurement (k = 0 is measured rarely) must not tilt every decision."""
        larger = [t for m, t in self.t_verify.items() if m > k]
        if k in self.t_verify:
            value = self.t_verify[k]
        else:
            lower = [m for m in self.t_verify if m < k]
            value = self.t_verify[max(lower)] if lower else min(larger)
        return min(value, *larger) if larger else value

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance[:k]:
            run *= a
            total += run
        return total

    def seconds_per_token(self, k: int) -> float:
        t_draft = 0.0 if self.t_draft is None else self.t_draft  # not measured yet: a free drafter, see choose
        return (k * t_draft + self.verify_cost(k)) / self.expected_tokens(k)

    def choose(self, limit: int, pending: int = 0) -> int:
        """k for the next round, at most min(limit, k_max); `pending`: tokens the draft must catch up on
        before it can draft (0 for drafters without a model)."""
        self.filler = False
        top = min(limit, self.k_max)
        if top <= 0:
            return 0
        if 0 not in self.t_verify:
            return 0  # measure plain decoding once: it is the alternative every k is weighed against
        if self.t_draft is None and len(self.t_verify) < 2:
            self.filler = True  # learn t_verify(1) from a free guess, not from a costly draft
            return 1
        # candidates: up to one past the largest measured k (exploration climbs one k at a time)
        best = min(range(min(top, max(self.t_verify) + 1) + 1), key=self.seconds_per_token)
        if self._benched or self.seconds_per_token(best) > (1.0 - self.margin) * self.verify_cost(0):
            best = 0
        per_token = self.catchup_token_cost()
        catchup = pending * per_token if pending and per_token is not None else None
        if best > 0 and catchup is not None:
            saved = (self.verify_cost(0) - self.seconds_per_token(best)) * limit
            if saved < catchup:
                return 0  # catching the draft up costs more than speculating can win back in this generation
        if best == 0:
            self._off_rounds += 1
            self._gen_off_rounds += 1
            # a probe makes the draft catch up on everything it skipped: it waits until this generation has
            # decoded enough plain rounds that the catch-up stays under probe_overhead of them, and at least
            # the probe interval, which doubles after each failed probe
            catchup = self.t_catchup if catchup is None else catchup
            affordable = catchup / (self.probe_overhead * self.verify_cost(0))
            if self._off_rounds >= self._interval and self._gen_off_rounds >= affordable:
                self._off_rounds = self._gen_off_rounds = 0
                self._interval = min(2 * self._interval, self.max_probe_every)
                self._probing = True
                self._benched, self._saving, self._judged = False, None, 0  # the probe judges afresh
                return 1
        else:
            self._off_rounds = 0
            self._interval = self.probe_every
        return best

    def update(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float | None,
               catchup_seconds: float = 0.0, catchup_tokens: int = 0, round_seconds: float | None = None,
               plain_tokens: int | None = None) -> None:
        """After a round that drafted k tokens (accepted of them) and took these times (catch-up: the
        draft's prefill of `catchup_tokens` tokens it had not seen, outside draft_seconds; verify None:
        the round's target pass was not a verify pass over k+1 tokens, e.g. the prefill gave its logits).
        `round_seconds`: the round's wall time (drafting, verifying, rollbacks), catch-up excluded; `plain_tokens`: how
        many target passes plain decoding would have made for its tokens (accepted + 1, one less in the
        first round, whose first token the prefill gave); with them the round's saving is judged."""
        if catchup_seconds > 0.0:
            self.t_catchup = catchup_seconds
            if catchup_tokens > 0:
                self.t_catchup_token = self._ema(self.t_catchup_token, catchup_seconds / catchup_tokens)
        if verify_seconds is not None:
            self.observe_verify(k + 1, verify_seconds)
        if k == 0:
            return
        # a probe's draft cost replaces the old estimate outright: that one may date from a slow spell (another
        # process on the cores) that switched drafting off, and averaging it away would take many rare probes
        self.t_draft = draft_seconds / k if self._probing else self._ema(self.t_draft, draft_seconds / k)
        if round_seconds is not None and not self._probing and 0 in self.t_verify:
            self._judge((accepted + 1 if plain_tokens is None else plain_tokens) * self.verify_cost(0) - round_seconds)
        self._probing = False
        reached = min(accepted + 1, k)
        for i in range(reached):  # positions reached this round
            self.acceptance[i] = self._ema(self.acceptance[i], 1.0 if i < accepted else 0.0)
        # Positions beyond k are not observed while k stays below them, so a bad early estimate there would
        # stick; let each drift towards the one before it so that deeper drafts get tried again.
        for i in range(max(k, 1), self.k_max):
            self.acceptance[i] += self.explore * (self.acceptance[i - 1] - self.acceptance[i])

    def _judge(self, saved: float) -> None:
        """One drafting round saved `saved` seconds over plain decoding (negative: lost). A probe's round is
        not judged: k = 1 rarely pays on its own, it measures acceptance."""
        self._judged += 1
        self._saving = saved if self._saving is None else self._ema(self._saving, saved)
        if self._judged < self.judge_after:
            return
        if self._saving >= 0.0:
            self._bench_interval = self.probe_every
        elif not self._benched:  # back off like failed probes do: a source that keeps losing is probed rarely
            self._benched = True
            self._bench_interval = min(2 * self._bench_interval, self.max_probe_every)
            self._interval, self._off_rounds = self._bench_interval, 0


class CostAwareK:
    """The cost-aware k policy (see the module docstring) behind the `KPolicy` interface: one `AdaptiveK`
    per draft source sharing the verify costs; a filler round verifies a free guess from prompt lookup."""

    def __init__(self, k_max: int = 8) -> None:
        self.root = AdaptiveK(k_max=k_max)
        self.k_max = k_max
        self._policy: AdaptiveK = self.root  # the sub-policy that chose the last plan

    @property
    def by_source(self) -> dict[str, AdaptiveK]:
        return self.root.by_source

    def start(self, prefill_seconds: float, prefill_tokens: int) -> None:
        self.root.observe_prefill(prefill_seconds, prefill_tokens)
        self.root.new_generation()

    def choose(self, view: RoundView) -> Plan:
        policy = self._policy = self.root.for_source(view.source)
        if view.limit > 0 and policy.wants_draft_cost():
            step = view.time_draft_step()
            if step is not None:
                policy.observe_draft_step(step)
        k = policy.choose(view.limit, view.pending)
        if policy.filler:
            guess = torch.tensor([lookup_guess(view.seq.ids)], dtype=torch.long).to(view.seq.buffer.device)
            return Plan(1, Draft(guess, None, "guess"))
        return Plan(k)

    def observe(self, report: RoundReport) -> None:
        policy = self._policy
        if report.fed:
            policy.observe_verify(report.fed, report.verify_seconds)
        if not report.own_draft:
            policy.update(report.drafted, report.accepted, report.draft_seconds, None, report.catchup_seconds,
                          report.catchup_tokens, round_seconds=report.seconds - report.catchup_seconds,
                          plain_tokens=report.plain_tokens)
