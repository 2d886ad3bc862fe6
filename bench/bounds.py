"""The best any k policy can do with a drafter: greedy speculation worked out from plain decoding's output.

Greedy speculation commits exactly the target's plain greedy tokens, so every round's outcome follows from the
plain output alone: a round at generated position i (i tokens committed) drafting k tokens accepts the longest
prefix of its draft that equals the plain continuation, and the target adds one token. So from one plain
decoding per prompt, each drafter's outcome at every position (a `Round`):

- a free drafter (suffix, n-gram) is asked for its draft at every position, as the engine asks it
  (`free_rounds`); its history carries from prompt to prompt when one proposer sees them all, as in a process;
- a draft model's greedy chain at position i is accepted for exactly the run of positions from i on where its
  argmax given the true prefix equals the target's token, so one teacher-forced forward over prompt + output
  gives every round's outcome (`model_rounds`);
- a drafter whose every draft is accepted (`perfect_rounds`) stands for the best draft model there could be.

With the measured costs of the target's pass over n new tokens (`Costs.verify`, n = 1 .. k_max + 1) and of a
draft model's step, a round of k drafts costs verify[k + 1] + k * step, and plain decoding verify[1] a token
after the prefill's first. The first round (i = 0) is the engine's: one target pass feeds the prompt (what of it
the cache does not hold; a prompt longer than the engine's prefill chunk goes in over several passes, the last
one this round's) and the round's k drafts, and gives the first token; a draft model drafts no first round (the
engine's rule: the first token does not wait for the draft's prefill). Its prompt's part is the prefill
(`Text.prefill`, outside the decoding seconds counted here), so the round costs what its drafts add to that pass,
k * (`Costs.prefill_token` + step), and nothing when k = 0.

- `oracle_seconds`: the fewest seconds over every choice of drafter and k at every round, each round's outcome
  known (dynamic programming over positions). No policy over these drafters can beat it; over the perfect
  drafter, at the envelope of the verify costs, no draft model can, chain or tree.
- `decode_seconds`: any policy's seconds (a fixed k; one k per draft source, `per_source_table`).
- `policy_seconds`: a k policy itself (verispec's cost-aware k) replayed with a free drafter, its passes priced
  at the measured costs instead of timed, so that its choices are judged without a machine's noise.

A round that drafts after a spell of rounds without the draft model is charged no catch-up for it: an
optimistic price, as a bound's must be. A round whose drafts run past the end of text counts its accepted drafts
up to that end (the engine's verifier may count agreeing drafts beyond it before the stop cuts them; the round's
tokens and cost are the same either way).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from verispec.backends.base import common_prefix_length
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.decoding.engine import PREFILL_CHUNK
from verispec.decoding.policies.base import KPolicy, RoundReport, RoundView
from verispec.names.drafters import DRAFT_MODEL_SOURCES

# at generated position i: (source, [(tokens drafted, tokens accepted) of a draft asked for k tokens, k = 1 ..
# k_max]); a free drafter may draft fewer tokens than asked, or none (source 'none')
Round = tuple[str, list[tuple[int, int]]]


@dataclass
class Text:
    """One prompt's plain greedy decoding, and each drafter's rounds at each generated position."""

    prompt: list[int]
    output: list[int]
    budget: int = 0  # the generation's max_new_tokens (0: len(output)); it caps k as in the engine
    cached: int = 0  # prompt tokens the target's cache already held (kept from the slot's last sequence)
    prefill: float = 0.0  # seconds of the target's prefill of the prompt (of what its cache did not hold)
    draft_prefill: float = 0.0  # seconds of the draft model's prefill of the prompt
    decode: float = 0.0  # seconds plain decoding took after the prefill, as timed
    rounds: dict[str, list[Round]] = field(default_factory=dict)  # drafter -> a Round per i = 0 .. len(output) - 1

    def limit(self, i: int, source: str = "") -> int:
        """The most drafts the engine lets a round at generated position i have, from `source` (a draft model
        drafts no first round)."""
        if i == 0 and source in DRAFT_MODEL_SOURCES:
            return 0
        return (self.budget or len(self.output)) - 1 - i

    @property
    def fed(self) -> int:
        """Prompt tokens the target's passes feed (at least the prompt's last one, whose logits give the first
        token)."""
        return len(self.prompt) - min(self.cached, len(self.prompt) - 1)


@dataclass(frozen=True)
class Costs:
    """Seconds of the target's pass over n new tokens (`verify[n]`, n = 1 .. k_max + 1), of one step of each
    drafter that has a model (`steps`; free drafters are absent), and per token of the prompt's pass
    (`prefill_token`: what each draft of a first round adds to the pass that feeds the prompt; 0: they ride
    free)."""

    verify: dict[int, float]
    steps: dict[str, float] = field(default_factory=dict)
    prefill_token: float = 0.0

    def round(self, i: int, drafter: str, drafted: int) -> float:
        """A round at generated position i that drafted `drafted` tokens, the prefill excluded: the first round
        (i = 0) feeds its drafts in the prompt's pass, every other one [last committed token, drafts] in a pass of
        its own."""
        step = drafted * self.steps.get(drafter, 0.0)
        if i == 0:
            return drafted * self.prefill_token + step
        return self.verify[drafted + 1] + step

    def envelope(self) -> Costs:
        """The same costs with a pass over n tokens priced at the cheapest measured pass over n or more: what a
        drafter that pads its draft (a tree can always verify more nodes) pays at least."""
        verify = {n: min(v for m, v in self.verify.items() if m >= n) for n in self.verify}
        return Costs(verify, dict(self.steps), self.prefill_token)

    def plain(self, text: Text) -> float:
        """Plain decoding of text.output after the prefill (which gives its first token)."""
        return max(0, len(text.output) - 1) * self.verify[1]


def free_rounds(proposer, text: Text, k_max: int) -> list[Round]:
    """A free drafter's Round at each generated position, asked as the engine asks it: its source, then a draft
    of k tokens for each k. A proposer that keeps a history across generations (suffix) carries it on to the
    next text it is given."""
    out = text.output
    seq = TokenSequence(text.prompt, len(text.prompt) + len(out) + 1, torch.device("cpu"))
    proposer.start(seq, SamplingParams(), torch.Generator())
    rows: list[Round] = []
    for i in range(len(out)):
        source, truth, counts = proposer.source(seq), out[i:], []
        for k in range(1, k_max + 1):
            draft = proposer.propose(seq, k).tokens.tolist()  # the engine asks whatever the source
            counts.append((len(draft), common_prefix_length(draft, truth)))
        rows.append((source, counts))
        seq.extend([out[i]], torch.tensor([out[i]]))
    return rows


def model_rounds(guesses: list[int], text: Text, k_max: int) -> list[Round]:
    """A draft model's greedy Round at each generated position, from its teacher-forced argmax over prompt +
    output: guesses[j] is its token after (prompt + output)[: j + 1]."""
    ids = text.prompt + text.output
    p = len(text.prompt)
    run = [0] * (len(ids) + 1)  # run[j]: how many tokens from ids[j] on the draft guesses right in a row
    for j in range(len(ids) - 1, p - 1, -1):
        run[j] = run[j + 1] + 1 if guesses[j - 1] == ids[j] else 0
    return [("model", [(k, min(k, run[p + i])) for k in range(1, k_max + 1)]) for i in range(len(text.output))]


def perfect_rounds(text: Text, k_max: int, source: str = "perfect") -> list[Round]:
    """A drafter whose every draft is accepted: with a draft model's step cost and the envelope of the verify
    costs, the oracle over it is the ceiling of any draft model, chain or tree, since a round that commits d + 1
    tokens needs a draft at least d deep (d draft forwards, each at least one step) and a pass over at least
    d + 1 tokens."""
    n = len(text.output)
    return [(source, [(k, min(k, n - i)) for k in range(1, k_max + 1)]) for i in range(n)]


# a policy: at generated position i, (drafter, k)
Policy = Callable[[int], tuple[str, int]]


def simulate(text: Text, policy: Policy) -> list[tuple[int, str, int, int]]:
    """The rounds that decode text.output, each round's drafter and k from `policy` (k capped as the engine
    caps it, so that a round never commits past the output): (position, drafter, drafted, accepted) each."""
    n, i, trace = len(text.output), 0, []  # a round that accepts an end of text ends past n
    while i < n:
        drafter, k = policy(i)
        k = min(k, text.limit(i, text.rounds[drafter][i][0]))
        drafted, accepted = text.rounds[drafter][i][1][k - 1] if k > 0 else (0, 0)
        trace.append((i, drafter, drafted, accepted))
        i += accepted + 1
    return trace


def trace_seconds(trace: list[tuple[int, str, int, int]], costs: Costs) -> float:
    """Seconds of the rounds of a `simulate` trace."""
    return sum(costs.round(i, drafter, drafted) for i, drafter, drafted, _ in trace)


def decode_seconds(text: Text, policy: Policy, costs: Costs) -> float:
    """Seconds to decode text.output after the prefill, the rounds chosen by `policy`."""
    return trace_seconds(simulate(text, policy), costs)


def oracle_seconds(text: Text, drafters: Iterable[str], costs: Costs, k_max: int) -> float:
    """The fewest seconds to decode text.output after the prefill, over every drafter and k at every round,
    each round's outcome known."""
    drafters = list(drafters)
    n = len(text.output)
    best = [0.0] * (n + 2)  # a round that accepts an end of text reaches n + 1
    for i in range(n - 1, -1, -1):
        options = [costs.round(i, "", 0) + best[i + 1]]
        for d in drafters:
            source, counts = text.rounds[d][i]
            for k in range(1, min(k_max, text.limit(i, source)) + 1):
                drafted, accepted = counts[k - 1]
                options.append(costs.round(i, d, drafted) + best[i + accepted + 1])
        best[i] = min(options)
    return best[0]


def per_source_policy(text: Text, drafter: str, table: dict[str, int]) -> Policy:
    """k = table[the round's source] (0 for a source not in it)."""
    return lambda i: (drafter, table.get(text.rounds[drafter][i][0], 0))


def per_source_table(texts: list[Text], drafter: str, costs: Costs, k_max: int, sweeps: int = 3) -> dict[str, int]:
    """The fixed k per draft source that decodes `texts` fastest in hindsight (coordinate descent over the
    sources from k = 0: what a policy that learns per source at best converges to)."""
    sources = sorted({s for t in texts for s, _ in t.rounds[drafter]} - {"none"})
    table = {s: 0 for s in sources}

    def total(tab: dict[str, int]) -> float:
        return sum(decode_seconds(t, per_source_policy(t, drafter, tab), costs) for t in texts)

    for _ in range(sweeps):
        for s in sources:
            table[s] = min(range(k_max + 1), key=lambda k: total({**table, s: k}))
    return table


def acceptance_per_depth(rounds: list[Round], depths: int) -> list[float]:
    """Of the k_max drafts that reach depth d with the d - 1 before accepted, the share accepted, d = 1 ..
    depths."""
    drafts = [c[-1] for _, c in rounds if c[-1][0]]
    return [sum(1 for n, a in drafts if n >= d and a >= d) / max(1, sum(1 for n, a in drafts if n >= d and a >= d - 1))
            for d in range(1, depths + 1)]


def mean_accepted_length(rounds: list[Round]) -> float:
    """Tokens a round of a k_max draft commits on average, where a draft is made (the target's own included)."""
    drafts = [c[-1][1] for _, c in rounds if c[-1][0]]
    return sum(a + 1 for a in drafts) / len(drafts) if drafts else 1.0


def policy_seconds(text: Text, drafter: str, policy: KPolicy, costs: Costs,
                   prefill_chunk: int = PREFILL_CHUNK) -> float:
    """Seconds a k policy takes to decode text.output after the prefill with a free drafter: the engine's
    exchange with the policy replayed (its views, its own drafts, its reports), every pass priced at `costs`
    instead of timed, so that a policy is judged without a machine's noise. A free drafter's rounds need no
    catch-up, so nothing the engine would do is left out; `policy` keeps what it learnt from texts before.

    The first round's report is the engine's: its pass fed the prompt's last part (the engine feeds a prompt at
    most `prefill_chunk` tokens a pass, the earlier parts in passes the policy is not shown) and the drafts, and
    took that part's share of `text.prefill` plus what the drafts add (`Costs.round`)."""
    out, rounds = text.output, text.rounds[drafter]
    k_max = len(rounds[0][1]) if rounds else 1
    seq = TokenSequence(text.prompt, len(text.prompt) + len(out) + 1, torch.device("cpu"))
    last_part = (text.fed - 1) % prefill_chunk + 1  # the prompt's tokens in the first round's pass
    policy.start()
    i, total = 0, 0.0
    while i < len(out):
        source, counts = rounds[i]
        limit = text.limit(i, source)
        plan = policy.choose(RoundView(seq, limit, source, 0, lambda: None))
        if plan.draft is not None:  # the policy's own draft (a free guess)
            guess = plan.draft.tokens.tolist()
            drafted, accepted = len(guess), common_prefix_length(guess, out[i:])
        else:
            k = min(plan.k, limit, k_max)
            drafted, accepted = counts[k - 1] if k > 0 else (0, 0)
        seconds = costs.round(i, drafter, drafted)
        fed, pass_seconds = drafted + 1, seconds  # a free drafter's rounds: all of it is the target's pass
        if i == 0:
            fed, pass_seconds = last_part + drafted, text.prefill * last_part / text.fed + seconds
        label = plan.draft.source if plan.draft is not None else source
        policy.observe(RoundReport(k=plan.k, source=label if drafted else "", drafted=drafted, accepted=accepted,
                                   fed=fed, first=i == 0, own_draft=plan.draft is not None, draft_steps=0,
                                   draft_seconds=0.0, verify_seconds=pass_seconds, catchup_seconds=0.0,
                                   catchup_tokens=0, seconds=pass_seconds))
        committed = out[i : i + accepted + 1]
        seq.extend(committed, torch.tensor(committed))
        total += seconds
        i += accepted + 1
    return total
