"""Cost-aware adaptive k: each round, pick the number of draft tokens that maximises expected tokens per
second, from the recent acceptance per draft position and the measured draft and verify costs.

With a_i = P(draft i accepted | drafts before it accepted), a round of k drafts emits on average
E(k) = 1 + sum_{j=1..k} prod_{i<=j} a_i tokens and costs T(k) = k * t_draft + t_verify(k). k = 0 is plain
decoding (E = 1, T = t_verify(0)); when nothing beats it, speculation switches itself off, probing now and
then with k = 1 so that it can switch back on. Only speed depends on these choices, never the output.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class AdaptiveK:
    k_max: int = 8
    decay: float = 0.85  # weight of the past in the running estimates
    probe_every: int = 16  # rounds between k = 1 probes while speculation is off
    prior_acceptance: float = 0.6
    acceptance: list[float] = field(default_factory=list)  # a_i, i = 0 .. k_max-1
    t_draft: float | None = None  # seconds per draft forward (None: not measured yet)
    t_verify: dict[int, float] = field(default_factory=dict)  # k -> seconds of a verify pass over k+1 tokens
    _off_rounds: int = 0

    def __post_init__(self) -> None:
        if self.k_max < 1:
            raise ValueError(f"k_max must be >= 1, got {self.k_max}")
        if not 0.0 < self.decay < 1.0:
            raise ValueError(f"decay must be in (0, 1), got {self.decay}")
        if not self.acceptance:
            self.acceptance = [self.prior_acceptance] * self.k_max

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1.0 - self.decay) * new

    def verify_cost(self, k: int) -> float:
        """Measured, or interpolated from the nearest measured k (verify cost grows slowly with k)."""
        if k in self.t_verify:
            return self.t_verify[k]
        nearest = min(self.t_verify, key=lambda m: (abs(m - k), m))
        return self.t_verify[nearest]

    def expected_tokens(self, k: int) -> float:
        total, run = 1.0, 1.0
        for a in self.acceptance[:k]:
            run *= a
            total += run
        return total

    def choose(self, limit: int) -> int:
        """k for the next round, at most min(limit, k_max)."""
        top = min(limit, self.k_max)
        if top <= 0:
            return 0
        if self.t_draft is None or not self.t_verify:
            return top  # nothing measured yet: draft, and learn
        best = max(range(top + 1), key=lambda k: self.expected_tokens(k) / (k * self.t_draft + self.verify_cost(k)))
        if best == 0:
            self._off_rounds += 1
            if self._off_rounds >= self.probe_every:
                self._off_rounds = 0
                return 1
        else:
            self._off_rounds = 0
        return best

    def update(self, k: int, accepted: int, draft_seconds: float, verify_seconds: float) -> None:
        """After a round that drafted k tokens (accepted of them) and took these times."""
        self.t_verify[k] = self._ema(self.t_verify.get(k), verify_seconds)
        if k == 0:
            return
        self.t_draft = self._ema(self.t_draft, draft_seconds / k)
        for i in range(min(accepted + 1, k)):  # positions reached this round
            self.acceptance[i] = self._ema(self.acceptance[i], 1.0 if i < accepted else 0.0)
