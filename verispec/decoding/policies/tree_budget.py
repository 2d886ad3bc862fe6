"""The k policy of token trees: each round, the node budget and depth that maximise expected tokens per second.

A tree of n nodes grown over d draft forwards emits on average 1 + E(d, n) tokens (E: accepted nodes) and
costs d * t_step + t_verify(n + 1) (a step: one draft forward over a frontier; the pass: the root and the n
nodes). Plain decoding emits 1 token for t_verify(1): trees are drafted only while one is expected to beat it.
Only speed depends on these choices, never the output: every tree is verified exactly.

Both terms are measured, and pooled so that no single noisy measurement decides:
- `VerifyCost`: per fed token count, the median of its recent passes; unmeasured counts interpolate between
  measured ones. Not a curve fit: on a CPU the cost per row count has regimes (matmul kernels that switch
  paths with the row count), which the policy exploits by picking the counts that are cheap.
- `AcceptedTable`: E(d, n) from the trees verified so far. The best-scored n nodes of depth <= d of a grown
  tree form a smaller tree (parents score at least as high as their children), the tree the drafter would have
  grown with that depth and budget, and the accepted path restricted to them is what it would have accepted
  (the target's draws at the nodes are the same). So every verified tree measures E for every (d, n) it
  contains, not just its own. Trees larger than the chosen one are measured in probe rounds (the largest tree,
  every `probe_every` rounds, and while nothing is measured yet); a plain round between probes measures plain
  decoding's cost again.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from verispec.core.tree import TokenTree
from verispec.decoding.policies.base import Plan, RoundReport, RoundView, ema
from verispec.names.drafters import Source
from verispec.proposers.tree_draft import TREE_DEPTH

TREE_MAX_NODES = 32  # the largest node budget an auto tree tries


@dataclass
class VerifyCost:
    """Seconds of a target pass per fed token count: the median of the count's last `window` passes, so that one
    slow outlier does not decide a count; between measured counts, a linear interpolation, and past the largest
    the largest's cost (optimistic: a count priced too low gets tried and measured). No monotone curve is
    imposed: matmul kernels can make a pass over more rows cheaper than one over fewer (MKL's fp32 x·Wᵀ, which
    verispec.backends.linear avoids, is one such)."""

    window: int = 5
    passes: dict[int, deque] = field(default_factory=dict)

    def observe(self, tokens: int, seconds: float) -> None:
        self.passes.setdefault(tokens, deque(maxlen=self.window)).append(seconds)

    @property
    def plain(self) -> float | None:
        """A one-token pass: plain decoding's step."""
        return self.seconds(1) if 1 in self.passes else None

    def seconds(self, tokens: int) -> float | None:
        """The expected seconds of a pass over `tokens` tokens (None: nothing measured)."""
        if tokens in self.passes:
            return statistics.median(self.passes[tokens])
        lower = [n for n in self.passes if n < tokens]
        higher = [n for n in self.passes if n > tokens]
        if not lower and not higher:
            return None
        if not higher or not lower:
            return self.seconds(max(lower) if lower else min(higher))
        a, b = max(lower), min(higher)
        return self.seconds(a) + (self.seconds(b) - self.seconds(a)) * (tokens - a) / (b - a)


@dataclass
class AcceptedTable:
    """E(d, n): accepted nodes of the best-scored n nodes of depth <= d, a running mean over verified trees."""

    max_depth: int = TREE_DEPTH
    max_nodes: int = TREE_MAX_NODES
    decay: float = 0.9
    mean: dict[tuple[int, int], float] = field(default_factory=dict)

    def observe(self, tree: TokenTree, path: tuple[int, ...], depth: int) -> None:
        """A tree grown over `depth` draft forwards was verified and `path` accepted."""
        order = sorted(range(len(tree)), key=lambda i: (-tree.scores[i], tree.depths[i], i))
        accepted = set(path)
        for d in range(1, min(depth, self.max_depth) + 1):
            total = 0
            for n, node in enumerate((i for i in order if tree.depths[i] <= d), start=1):
                if n > self.max_nodes:
                    break
                total += node in accepted
                self.mean[d, n] = ema(self.mean.get((d, n)), float(total), self.decay)

    def expected(self, depth: int, nodes: int) -> float | None:
        return self.mean.get((depth, nodes))


class TreeBudget:
    """The `KPolicy` of a tree drafter with k = auto: Plan(k = node budget, depth = draft forwards), or 0."""

    def __init__(self, max_nodes: int = TREE_MAX_NODES, max_depth: int = TREE_DEPTH, probe_every: int = 16) -> None:
        if max_nodes < 1 or max_depth < 1 or probe_every < 1:
            raise ValueError("max_nodes, max_depth and probe_every must be >= 1")
        self.max_nodes, self.max_depth, self.probe_every = max_nodes, max_depth, probe_every
        self.verify = VerifyCost()
        self.accepted = AcceptedTable(max_depth, max_nodes)
        self.t_step: float | None = None  # seconds per draft forward
        self.rounds = 0

    def start(self) -> None:
        pass

    def choose(self, view: RoundView) -> Plan:
        if view.limit < 1 or view.source == Source.NONE or self.verify.plain is None:
            return Plan(0)  # a plain round measures the pass every tree is weighed against
        self.rounds += 1
        depth_cap = min(self.max_depth, view.limit)
        if self.t_step is None or not self.accepted.mean or self.rounds % self.probe_every == 0:
            return Plan(self.max_nodes, depth=depth_cap)  # the largest tree: measures E for every smaller one
        if self.rounds % self.probe_every == self.probe_every // 2:
            return Plan(0)  # plain decoding's cost again, so that no early timing decides it for good
        best, plan = 1.0 / self.verify.plain, Plan(0)
        for (d, n), accepted in self.accepted.mean.items():
            if d > depth_cap:
                continue
            seconds = self.verify.seconds(n + 1)
            if seconds is None:
                continue
            rate = (1.0 + accepted) / (d * self.t_step + seconds)
            if rate > best:
                best, plan = rate, Plan(n, depth=d)
        return plan

    def observe(self, report: RoundReport) -> None:
        if not report.first:  # a first round's pass is mostly the prompt's prefill
            self.verify.observe(report.fed, report.verify_seconds)
        if report.drafted and report.draft_steps:
            self.t_step = ema(self.t_step, report.draft_seconds / report.draft_steps, 0.85)
        if report.tree is not None and report.tree.scores:
            self.accepted.observe(report.tree, report.path, report.draft_steps)
