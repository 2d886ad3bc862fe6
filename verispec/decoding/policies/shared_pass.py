"""k for the rows that share a round's target pass: drafts go where they earn more than the width they add costs.

A lone sequence weighs k drafts against its own pass (verispec.decoding.policies.cost_aware). When several rows
share one pass, a row's drafts make the pass wider for all of them, and a draft is worth its column only where it
is likely to be accepted: a pass over W tokens costs t(W), and row r, drafting k_r tokens from its source, emits
E(k_r) = 1 + a_1 + a_1 a_2 + ... tokens on average. The round's rate is sum_r E(k_r) / (t(W) + draft steps). Starting
from plain decoding for every row, one draft at a time goes to the row where it adds the most expected tokens per
second of added cost (its column, and a draft step where it drafts deeper than the model rows before it), as long as
that beats the round's current tokens per second by `margin`. The pass costs t(W) and acceptances a_i are the lone
policy's own (a pass over W tokens costs the same whoever the tokens belong to; a source's acceptance is its own), so
what a lone sequence learns plans shared rounds and the other way round; a width never measured is priced as the
nearest measured narrower one, and only one width past the widest measured is tried, as for a lone sequence.
A shared round's draft step (one forward for every drafting row) is learnt per source on its own.

A source planned out of every round would never be measured again: every `probe_every` shared rounds in which no
row drafts, the first row whose source has a draft drafts one token.
"""

from __future__ import annotations

from typing import Any, Protocol

from verispec.decoding.policies.base import Plan, RoundReport, RoundView, ema
from verispec.names.drafters import Source


class LonePolicy(Protocol):
    """What SharedPass reads and teaches of a lone sequence's policy (CostAwareK): the target's pass costs
    (`target`: verify(width), observe_verify, frontier, t_verify), the most drafts a row takes, and each source's
    draft costs and acceptance (`for_source(source)`: .costs.t_draft, .acceptance.rates, .acceptance.observe)."""

    target: Any
    k_max: int

    def for_source(self, source: str) -> Any: ...


class SharedPass:
    """Plans and learns the shared rounds of a lone policy (a CostAwareK: its target costs and per-source
    acceptance)."""

    def __init__(self, policy: LonePolicy, margin: float = 0.05, probe_every: int = 16, decay: float = 0.85) -> None:
        self.policy, self.margin, self.probe_every, self.decay = policy, margin, probe_every, decay
        self.steps: dict[str, float] = {}  # source -> seconds of one draft step shared by the round's drafting rows
        self._idle = 0  # shared rounds since one drafted

    def choose(self, views: list[RoundView], width: int, rows: int) -> list[Plan]:
        """The plans of the round's rows with k = 'auto' (`views`); `width`: the tokens the pass feeds without their
        drafts (every row's unseen tokens, other rows' drafts, prompt parts); `rows`: the rows that emit a token
        this round, these and others."""
        target = self.policy.target
        ks = [0] * len(views)
        if not views or width < 1 or width - 1 not in target.t_verify:
            return [Plan(0) for _ in views]  # the pass without drafts is measured first: what drafts are weighed by
        widest = target.frontier() + 1  # tokens of the widest pass worth trying
        tokens, seconds, depth = float(rows), target.verify(width - 1), {}
        while width < widest:
            best, best_rate, best_cost, best_gain = None, 0.0, 0.0, 0.0
            for i, view in enumerate(views):
                if ks[i] >= min(view.limit, self.policy.k_max) or view.source == Source.NONE:
                    continue
                gain = self._gain(view.source, ks[i])
                cost = max(0.0, target.verify(width) - target.verify(width - 1))
                step = self.steps.get(view.source, self.policy.for_source(view.source).costs.t_draft)
                if step is not None and ks[i] + 1 > depth.get(view.source, 0):
                    cost += step
                rate = gain / cost if cost > 0 else float("inf")
                if best is None or rate > best_rate:
                    best, best_rate, best_cost, best_gain = i, rate, cost, gain
            if best is None or best_gain <= 0 or best_rate <= (1.0 + self.margin) * tokens / seconds:
                break
            ks[best] += 1
            width, tokens, seconds = width + 1, tokens + best_gain, seconds + best_cost
            depth[views[best].source] = max(depth.get(views[best].source, 0), ks[best])
        if any(ks):
            self._idle = 0
        else:
            self._idle += 1
            if self._idle >= self.probe_every:
                probe = next((i for i, v in enumerate(views) if v.source != Source.NONE and v.limit > 0), None)
                if probe is not None:
                    ks[probe], self._idle = 1, 0
        return [Plan(k) for k in ks]

    def _gain(self, source: str, k: int) -> float:
        """Expected tokens the (k + 1)-th draft of `source` adds: the chance the first k + 1 are all accepted."""
        gain = 1.0
        for a in self.policy.for_source(source).acceptance.rates[: k + 1]:
            gain *= a
        return gain

    def observe(self, reports: list[RoundReport], width: int, prefill: bool) -> None:
        """The shared round planned last ran: `reports` of its rows with k = 'auto', `width` tokens in its pass;
        `prefill`: the pass fed a prompt too (its cost says nothing of a verify pass's)."""
        if not reports:
            return
        if not prefill:
            self.policy.target.observe_verify(width, reports[0].verify_seconds)
        steps: dict[str, int] = {}
        for r in reports:
            if r.drafted and not r.own_draft:
                self.policy.for_source(r.source).acceptance.observe(r.drafted, r.accepted)
                if r.draft_steps:
                    steps[r.source] = max(steps.get(r.source, 0), r.draft_steps)
        for source, n in steps.items():  # the rows of a source drafted in the same steps
            seconds = reports[0].draft_seconds / n
            self.steps[source] = ema(self.steps.get(source), seconds, self.decay)
