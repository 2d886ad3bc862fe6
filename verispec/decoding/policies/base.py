"""How many tokens to draft each round: the k policy interface, and the fixed-k policy.

The engine knows nothing of how k is chosen. Before each round it shows the policy a `RoundView` (how
many drafts the round may have, where the next draft would come from, what the draft must catch up on)
and gets a `Plan` back: k, or a ready draft of the policy's own (a free guess it wants verified, to learn
a cost). After the round it hands the policy the round's `RoundReport`. Only speed depends on these
choices, never the output: every draft is verified exactly.

`FixedK` drafts the same k every round; the cost-aware policy (`verispec.decoding.policies.cost_aware.CostAwareK`) picks the k
that maximises expected tokens per second from measured costs and acceptance.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from verispec.core.draft import Draft
from verispec.core.sequence import TokenSequence
from verispec.core.tree import TokenTree
from verispec.names.drafters import Source


def ema(old: float | None, new: float, decay: float) -> float:
    """The running mean after `new`, `decay` being the weight of the past (old None: no past yet): how every k policy
    keeps what it measures."""
    return new if old is None else decay * old + (1.0 - decay) * new


@dataclass(frozen=True)
class RoundView:
    """What a policy sees before a round."""

    seq: TokenSequence  # the committed sequence
    limit: int  # the most drafts this round may have (tokens left to generate, less the round's own)
    source: str  # where the proposer's next draft would come from ('none': it has none)
    pending: int  # tokens the draft must catch up on before it drafts (0 for free drafters)
    time_draft_step: Callable[[], float | None]  # seconds of one draft step on a token the draft must catch up
    # on anyway (None: nothing pending to time it on); the engine books it as catch-up


@dataclass(frozen=True)
class Plan:
    """A policy's choice for one round: draft k tokens, or verify `draft` (the policy's own) instead. A tree
    drafter reads k as its node budget and `depth` as the most draft forwards it may spend (None: its own
    maximum); a tree's deepest node is at most that deep, since a round commits at most its depth + 1 tokens."""

    k: int
    draft: Draft | None = None
    depth: int | None = None


@dataclass(frozen=True, kw_only=True)
class RoundReport:
    """What one round did and cost for one row (fields by name: a dozen numbers in a row are easily swapped). In a
    round of several rows the stage times are the round's, shared by its rows."""

    k: int  # drafts planned
    source: str  # where the verified draft came from ('' when none was verified)
    drafted: int  # draft tokens verified
    accepted: int  # of them accepted
    fed: int  # tokens the row fed to the round's target pass: [last, d_1..d_k], its prompt's last part too in the first
    first: bool  # the row's first round: its pass fed (the rest of) the prompt as well
    own_draft: bool  # the draft was the policy's (Plan.draft), not the drafter's
    draft_steps: int  # draft-model forwards spent on the draft (0: a free drafter)
    draft_seconds: float  # drafting, catch-up excluded
    verify_seconds: float  # the target pass and the verification
    catchup_seconds: float  # the draft's catch-up on tokens it had not seen
    catchup_tokens: int
    seconds: float  # wall time of the whole round (catch-up, drafting, verifying, both rollbacks)
    tree: "TokenTree | None" = None  # the verified draft's tree (None: a chain)
    path: tuple[int, ...] = ()  # the tree nodes accepted, root to deepest

    @property
    def plain_tokens(self) -> int:
        """Target passes plain decoding would have made for this round's tokens."""
        return self.accepted + 1


class KPolicy(Protocol):
    def start(self) -> None:
        """A generation starts."""

    def choose(self, view: RoundView) -> Plan:
        """The plan for the next round (k <= view.limit)."""

    def observe(self, report: RoundReport) -> None:
        """The round planned last has run."""


@runtime_checkable
class SharedKPolicy(KPolicy, Protocol):
    """A KPolicy that also plans rounds whose target pass several rows share, all its rows at once."""

    def choose_shared(self, views: list[RoundView], width: int, rows: int) -> list[Plan]:
        """The plans of this policy's rows (`views`); `width`: tokens the pass feeds besides their drafts; `rows`:
        the rows that emit a token this round, theirs and others."""

    def observe_shared(self, reports: list[RoundReport], width: int, prefill: bool) -> None:
        """The shared round planned last ran: its rows' reports, `width` tokens in its pass (`prefill`: a prompt's
        too)."""


class FixedK:
    """Draft k tokens every round (fewer near the end of the generation); k = 0 is plain decoding."""

    def __init__(self, k: int) -> None:
        if isinstance(k, bool) or not isinstance(k, int) or k < 0:
            raise ValueError(f"k must be an integer >= 0, got {k!r}")
        self.k = k

    def start(self) -> None:
        pass

    def choose(self, view: RoundView) -> Plan:
        if view.source == Source.TREE:  # k tree nodes; the limit caps the depth
            return Plan(self.k if view.limit else 0, depth=view.limit)
        return Plan(min(self.k, view.limit))

    def observe(self, report: RoundReport) -> None:
        pass
