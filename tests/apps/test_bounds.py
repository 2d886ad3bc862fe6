"""bench/bounds.py (beside bench/spec_bounds.py): greedy speculation's rounds worked out from plain decoding equal the
engine's real rounds, and the oracle is the fastest of all policies."""

from __future__ import annotations

import itertools
import random
import sys
from pathlib import Path

import pytest
import torch
from tiny import make_engine, perturbed, tiny_qwen2

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from bounds import (  # noqa: E402
    Costs,
    Text,
    acceptance_per_depth,
    decode_seconds,
    free_rounds,
    model_rounds,
    oracle_seconds,
    per_source_table,
    perfect_rounds,
    policy_seconds,
    simulate,
)

from verispec.backends import HFModel
from verispec.backends.base import Sequence
from verispec.core.draft import Draft
from verispec.core.sampling import SamplingParams
from verispec.decoding.engine import PREFILL_CHUNK
from verispec.decoding.policies.base import FixedK, Plan
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.proposers import NgramProposer, SuffixProposer

PROMPTS = [[5, 9, 13, 5, 9, 13, 21, 5, 9], [40, 41, 42, 43, 40, 41, 42, 7, 8, 40], [3, 3, 17, 29, 3, 3, 17]]
K_MAX = 6


class Recorder:
    """A k policy that drafts a fixed k and records each round's (drafted, accepted)."""

    def __init__(self, k: int) -> None:
        self.fixed, self.rounds = FixedK(k), []

    def start(self) -> None:
        self.rounds.append([])

    def choose(self, view):
        return self.fixed.choose(view)

    def observe(self, report) -> None:
        self.rounds[-1].append((report.drafted, report.accepted))


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(seed=1, scale=4.0)
    return target, perturbed(target, seed=2, noise=0.3)


def plain_texts(target, budget: int, eos: tuple[int, ...] = ()) -> list[Text]:
    engine = make_engine(target, k=0, eos=eos)
    return [Text(p, engine.generate(p, SamplingParams(), max_new_tokens=budget).token_ids, budget=budget)
            for p in PROMPTS]


def engine_rounds(target, draft, drafter: str, k: int, budget: int, eos: tuple[int, ...]) -> list[list[tuple]]:
    lookup = {"suffix": SuffixProposer, "ngram": lambda: NgramProposer(max_ngram=3, min_ngram=1)}.get(drafter)
    engine = make_engine(target, draft if drafter == "model" else None, k=k, eos=eos,
                         drafter="model" if lookup is None else lookup())
    recorder = engine.k_policy = Recorder(k)
    outputs = [engine.generate(p, SamplingParams(), max_new_tokens=budget, k="auto").token_ids
               for p in PROMPTS]
    return recorder.rounds, outputs


def simulated_rounds(texts: list[Text], draft, drafter: str) -> None:
    if drafter == "model":
        model = Sequence(HFModel(draft))
        for t in texts:
            model.reset()
            guesses = model.forward(torch.tensor(t.prompt + t.output)).argmax(dim=-1).tolist()
            t.rounds[drafter] = model_rounds(guesses, t, K_MAX)
        return
    proposer = SuffixProposer() if drafter == "suffix" else NgramProposer(max_ngram=3, min_ngram=1)
    for t in texts:  # one proposer for all, as the engine's: the suffix history carries over
        t.rounds[drafter] = free_rounds(proposer, t, K_MAX)


@pytest.mark.parametrize("drafter", ["model", "ngram", "suffix"])
@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("ends", ["length", "eos"])
def test_simulated_rounds_are_the_engines_rounds(pair, drafter, k, ends):
    """Every round of greedy speculation (drafted, accepted), the first round (a free drafter drafts in the pass
    that feeds the prompt, a draft model not) and one that reaches an end of text included, predicted from plain
    decoding's output alone."""
    target, draft = pair
    budget, eos = 40, ()
    if ends == "eos":  # a token plain decoding emits mid-way ends the generation there
        eos = (plain_texts(target, budget)[0].output[12],)
    texts = plain_texts(target, budget, eos)
    real, outputs = engine_rounds(target, draft, drafter, k, budget, eos)
    assert outputs == [t.output for t in texts]  # greedy speculation is plain decoding
    simulated_rounds(texts, draft, drafter)
    predicted = [[(d, a) for _, _, d, a in simulate(t, lambda i: (drafter, k))] for t in texts]
    assert predicted == real
    if drafter == "model":  # a draft model drafts no first round, and the second round's full k
        assert all(rounds[0][0] == 0 and rounds[1][0] == k for rounds in real)
    assert sum(a for rounds in real for _, a in rounds) > 0  # drafts were accepted: the test sees acceptance
    if ends == "eos":
        assert any(len(t.output) < budget for t in texts)


def random_text(rng: random.Random, n: int, drafters: list[str], k_max: int) -> Text:
    text = Text([1], [0] * n)
    for d in drafters:
        rows = []
        for _ in range(n):
            run = rng.choice([0, 0, 1, 2, 4, 8])
            width = rng.choice([k_max, k_max, 1, 0])
            rows.append((rng.choice(["a", "b"]), [(min(k, width), min(k, width, run)) for k in range(1, k_max + 1)]))
        text.rounds[d] = rows
    return text


def brute_force(text: Text, drafters: list[str], costs: Costs, k_max: int, i: int = 0) -> float:
    """Every choice at every round, enumerated."""
    if i >= len(text.output):
        return 0.0
    best = costs.round(i, "", 0) + brute_force(text, drafters, costs, k_max, i + 1)
    for d, k in itertools.product(drafters, range(1, min(k_max, text.limit(i)) + 1)):
        drafted, accepted = text.rounds[d][i][1][k - 1]
        best = min(best, costs.round(i, d, drafted) + brute_force(text, drafters, costs, k_max, i + accepted + 1))
    return best


def test_oracle_is_the_fastest_choice_at_every_round():
    rng = random.Random(0)
    k_max = 3
    costs = Costs({1: 1.0, 2: 1.5, 3: 2.0, 4: 1.7}, {"m": 0.3})
    for _ in range(30):
        text = random_text(rng, rng.randint(1, 9), ["f", "m"], k_max)
        oracle = oracle_seconds(text, ["f", "m"], costs, k_max)
        assert oracle == pytest.approx(brute_force(text, ["f", "m"], costs, k_max))
        for d, k in itertools.product(["f", "m"], range(k_max + 1)):
            assert oracle <= decode_seconds(text, lambda i, d=d, k=k: (d, k), costs) + 1e-12
        table = per_source_table([text], "f", costs, k_max)
        assert oracle_seconds(text, ["f"], costs, k_max) <= decode_seconds(
            text, lambda i, t=text, tab=table: ("f", tab.get(t.rounds["f"][i][0], 0)), costs) + 1e-12


def test_plain_decoding_costs_one_pass_per_token_after_the_prefill():
    """The first round's pass is the prefill's: without drafts it adds nothing, whatever a prompt token costs."""
    text = random_text(random.Random(1), 10, ["f"], 2)
    costs = Costs({1: 0.1, 2: 0.15, 3: 0.2}, prefill_token=0.05)
    assert decode_seconds(text, lambda i: ("f", 0), costs) == pytest.approx(costs.plain(text)) == pytest.approx(0.9)


def test_acceptance_per_depth_counts_only_drafts_that_reach_the_depth():
    rounds = [("s", [(3, 3)]), ("s", [(1, 1)]), ("s", [(3, 1)]), ("s", [(0, 0)])]
    # depth 1: 3 drafts, all accepted; depth 2: drafts of >= 2 tokens with the first accepted: 2, 1 accepted
    assert acceptance_per_depth(rounds, 3) == [1.0, 0.5, 1.0]


def test_a_replayed_policy_is_priced_like_its_rounds(pair):
    """policy_seconds replays a policy through the engine's exchange: FixedK costs what its simulated rounds
    cost (a first round's drafts priced in the prompt's pass), and the cost-aware policy, learning across the
    texts, is never faster than the oracle."""
    target, _ = pair
    texts = plain_texts(target, 40)
    simulated_rounds(texts, None, "ngram")
    costs = Costs({n: 0.1 + 0.04 * (n - 1) for n in range(1, K_MAX + 2)}, prefill_token=0.03)
    for k in (0, 2, 5):
        for t in texts:
            assert policy_seconds(t, "ngram", FixedK(k), costs) == pytest.approx(
                decode_seconds(t, lambda i, k=k: ("ngram", k), costs))
    policy = CostAwareK(k_max=K_MAX)
    for t in texts:
        assert policy_seconds(t, "ngram", policy, costs) >= oracle_seconds(t, ["ngram"], costs, K_MAX) - 1e-12
    assert policy.for_source("ngram").costs.target.t_verify  # it learnt the priced passes


@pytest.mark.parametrize("chunk, learnt", [(PREFILL_CHUNK, 0.1), (8, None)])
def test_a_replayed_cost_aware_policy_learns_the_prefill_from_the_first_round(chunk, learnt):
    """The first round's report carries the prompt's pass, as the engine's: 20 prompt tokens (2 of them cached)
    prefilled in 1.8 s teach 0.1 s a token; fed in chunks of 8, the first round's pass holds only the last 2,
    too few to learn from, and is not taken for a verify pass either."""
    text = Text(list(range(20)), [0] * 2, cached=2, prefill=1.8)  # a plain first round, then a plain last one
    text.rounds["f"] = [("none", [(0, 0)] * 2)] * 2
    policy = CostAwareK(k_max=2)
    costs = Costs({1: 0.1, 2: 0.15, 3: 0.2}, prefill_token=0.05)
    assert policy_seconds(text, "f", policy, costs, prefill_chunk=chunk) == pytest.approx(costs.plain(text))
    assert policy.target.t_prefill_token == pytest.approx(learnt)
    assert policy.target.t_verify == {0: pytest.approx(0.1)}


class Reactive:
    """A deterministic policy whose every choice depends on the reports before it: k grows with the last
    round's acceptance, and every fourth round verifies a free guess of its own. Replayed and real, it sees
    the same reports only if policy_seconds hands it the engine's (sources, own drafts, counts, the tokens each
    pass fed and which round was a first included)."""

    def __init__(self) -> None:
        self.log, self.k, self.rounds = [], 1, 0

    def start(self) -> None:
        self.rounds = 0

    def choose(self, view):
        self.rounds += 1
        if self.rounds % 4 == 0 and view.limit > 0:
            return Plan(1, Draft(torch.tensor([view.seq.ids[-2]]), None, "guess"))
        return Plan(min(self.k, view.limit))

    def observe(self, report) -> None:
        self.log.append((report.k, report.source, report.drafted, report.accepted, report.own_draft, report.fed,
                         report.first))
        if not report.own_draft:
            self.k = 1 + report.accepted if report.drafted else max(1, self.k - 1)


@pytest.mark.parametrize("chunk", [PREFILL_CHUNK, 4])
@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
def test_a_replayed_policy_sees_the_engines_reports(pair, drafter, chunk):
    """The first round of each generation drafts in the pass that feeds its prompt: what of the prompt the slot's
    cache lacks (the last prompt shares 5 tokens with the sequence before it), its last part where the engine
    feeds a prompt in chunks of 4."""
    target, _ = pair
    prompts = [*PROMPTS, PROMPTS[2][:5] + [50, 51]]
    plain = make_engine(target, k=0)
    texts = [Text(p, plain.generate(p, SamplingParams(), max_new_tokens=40).token_ids, budget=40, cached=cached)
             for p, cached in zip(prompts, [0, 0, 0, 5])]
    engine = make_engine(target, k=0, drafter=SuffixProposer() if drafter == "suffix" else "ngram")
    engine.prefill_chunk = chunk
    real = engine.k_policy = Reactive()
    outputs = [engine.generate(p, SamplingParams(), max_new_tokens=40, k="auto").token_ids
               for p in prompts]
    assert outputs == [t.output for t in texts]
    simulated_rounds(texts, None, drafter)
    replayed = Reactive()
    for t in texts:
        policy_seconds(t, drafter, replayed, Costs({n: 1.0 for n in range(1, K_MAX + 2)}), prefill_chunk=chunk)
    assert replayed.log == real.log
    assert any(own for *_, own, _, _ in real.log) and any(a for _, _, _, a, own, _, _ in real.log if not own)
    firsts = [(fed - drafted, drafted) for _, _, drafted, _, _, fed, first in real.log if first]
    assert [fed for fed, _ in firsts] == [(len(p) - cached - 1) % chunk + 1 for p, cached in zip(prompts, [0, 0, 0, 5])]
    assert any(drafted for _, drafted in firsts)  # a first round drafted


def test_the_ceiling_is_every_draft_accepted_at_the_cheapest_pass():
    """The perfect drafter's oracle is at most any drafter's with the same step cost, and worked out by hand on
    a small case: 7 tokens, passes 1.0 / 1.4 / 2.0 / 1.8 (the envelope prices 3 tokens at 1.8), a step 0.1."""
    rng = random.Random(2)
    costs = Costs({1: 1.0, 2: 1.4, 3: 2.0, 4: 1.8}, {"m": 0.1, "perfect": 0.1})
    assert costs.envelope().verify == {1: 1.0, 2: 1.4, 3: 1.8, 4: 1.8}
    for _ in range(20):
        text = random_text(rng, rng.randint(1, 12), ["m"], 3)
        text.rounds["perfect"] = perfect_rounds(text, 3)
        assert oracle_seconds(text, ["perfect"], costs.envelope(), 3) <= oracle_seconds(text, ["m"], costs, 3) + 1e-12
    text = Text([1], [0] * 7)
    text.rounds["perfect"] = perfect_rounds(text, 3)
    ended = Text([1], [0] * 7, budget=20)  # an end of text at 7: no draft is accepted past it
    ended.rounds["perfect"] = perfect_rounds(ended, 3)
    assert oracle_seconds(ended, ["perfect"], costs.envelope(), 3) <= oracle_seconds(text, ["perfect"], costs.envelope(), 3)
    # Round 0's drafts ride in the prompt's pass, here at no cost but their steps: round 0 drafts 3 (0.3) and commits
    # 4; round 4 may draft 2 (a pass over 3: 1.8 + 0.2) and commits the last 3.
    assert oracle_seconds(text, ["perfect"], costs.envelope(), 3) == pytest.approx(2.3)
    # At 0.5 a prompt token, round 0 drafts 2 (1.0 + 0.2) and commits 3; round 3 drafts 3 (a pass over 4: 1.8 + 0.3)
    # and commits the last 4: 3.3. Drafting 3 first (1.8, then 2.0) costs 3.8; a plain first round (free, then 2.1
    # for 4 tokens and 1.5 for 2) 3.6.
    priced = Costs(costs.verify, costs.steps, prefill_token=0.5).envelope()
    assert priced.prefill_token == 0.5
    assert oracle_seconds(text, ["perfect"], priced, 3) == pytest.approx(3.3)
    assert decode_seconds(text, lambda i: ("perfect", 3), priced) == pytest.approx(3.8)
    assert decode_seconds(text, lambda i: ("perfect", 3 * (i > 0)), priced) == pytest.approx(3.6)
