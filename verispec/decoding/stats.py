"""SpecStats: what one generation drafted, accepted and spent. Every front end reads it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class SpecStats:
    prompt_tokens: int = 0
    cached_tokens: int = 0  # of the prompt's tokens, those the target's cache held already (a common prefix)
    new_tokens: int = 0
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # [i]: rounds whose draft i was accepted
    drafted_per_position: list[int] = field(default_factory=list)  # [i]: rounds that drafted position i
    accepted_lengths: list[int] = field(default_factory=list)  # per drafting round: drafts accepted
    target_forwards: int = 0
    draft_forwards: int = 0
    target_seconds: float = 0.0
    draft_seconds: float = 0.0
    prefill_seconds: float = 0.0
    first_token_seconds: float = 0.0  # time to first token: from the call until the first token was committed
    seconds: float = 0.0

    def observe(self, drafted: int, accepted: int, depth: int | None = None) -> None:
        """One verification round: `accepted` of `drafted` draft tokens were accepted. A token tree's `depth`:
        the positions it drafted (its `drafted` nodes spread over them), so that position i's acceptance is
        the acceptance at depth i + 1."""
        self.rounds += 1
        self.drafted += drafted
        self.accepted += accepted
        self.accepted_lengths.append(accepted)
        positions = drafted if depth is None else depth
        for counts, upto in ((self.drafted_per_position, positions), (self.accepted_per_position, accepted)):
            if len(counts) < upto:
                counts.extend([0] * (upto - len(counts)))
            for i in range(upto):
                counts[i] += 1

    def add_round(self, report) -> None:
        """Book one round's `verispec.decoding.policies.base.RoundReport`: its costs, passes and, when it drafted, acceptance."""
        self.draft_seconds += report.draft_seconds
        self.prefill_seconds += report.catchup_seconds  # a draft's catch-up is prefill work
        self.target_seconds += report.verify_seconds
        self.draft_forwards += report.draft_steps
        self.target_forwards += 1  # one pass a round (the first one prefills the prompt too)
        if report.drafted:
            self.observe(report.drafted, report.accepted, None if report.tree is None else report.tree.depth)

    def cut_round(self, drafted: int, accepted: int, emitted: int, depth: int | None = None) -> None:
        """The last round (`drafted` drafts, or tree nodes over `depth` positions; `accepted` of them accepted)
        was cut by a stop (EOS or a stop string) after its first `emitted` tokens: when the cut falls among the
        accepted drafts, count the round as if it had drafted only those, so that the stats describe what was
        emitted."""
        if emitted >= accepted:
            return
        positions = drafted if depth is None else depth
        for counts, upto in ((self.drafted_per_position, positions), (self.accepted_per_position, accepted)):
            for i in range(emitted, upto):
                counts[i] -= 1
        self.drafted -= drafted - emitted
        self.accepted -= accepted - emitted
        if self.accepted_lengths:
            self.accepted_lengths[-1] = emitted

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verification round (accepted + 1)."""
        return (self.accepted + self.rounds) / self.rounds if self.rounds else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        decode = self.seconds - self.prefill_seconds
        return self.new_tokens / decode if decode > 0 else 0.0

    def merge(self, other: "SpecStats") -> None:
        """Accumulate another generation's stats (e.g. across chat turns)."""
        for name in (
            "prompt_tokens", "cached_tokens", "new_tokens", "rounds", "drafted", "accepted", "target_forwards",
            "draft_forwards", "target_seconds", "draft_seconds", "prefill_seconds", "first_token_seconds", "seconds",
        ):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        for mine, theirs in (
            (self.drafted_per_position, other.drafted_per_position),
            (self.accepted_per_position, other.accepted_per_position),
        ):
            mine.extend([0] * (len(theirs) - len(mine)))
            for i, c in enumerate(theirs):
                mine[i] += c
        self.accepted_lengths.extend(other.accepted_lengths)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(
            acceptance_rate=self.acceptance_rate,
            mean_accepted_length=self.mean_accepted_length,
            tokens_per_second=self.tokens_per_second,
            decode_tokens_per_second=self.decode_tokens_per_second,
        )
        return d

    def summary(self) -> str:
        s = f"{self.new_tokens} tokens in {self.seconds:.2f}s ({self.tokens_per_second:.2f} tok/s)"
        if self.drafted:
            s += (
                f" | acceptance {self.acceptance_rate:.1%} ({self.accepted}/{self.drafted})"
                f" | mean accepted length {self.mean_accepted_length:.2f}"
            )
        return s + f" | target forwards {self.target_forwards}"
