"""Token-tree speculation (verispec.core.tree, proposers/tree.py, tree_budget.py): exact at every depth."""

from __future__ import annotations

import random

import pytest
import torch
from stats_util import chi2_pvalue
from test_engine import ALPHA, _exact_marginals
from tiny import lone_rounds, make_engine, perturbed, text_pair, tiny_qwen2

import verispec
from verispec.backends.base import Sequence
from verispec.backends.lean import LeanBatch, LeanNet
from verispec.core.rows import target_rows, tree_rows
from verispec.core.sampling import SamplingParams, sample
from verispec.core.sequence import TokenSequence
from verispec.core.tree import ROOT, TokenTree, verify_tree
from verispec.decoding import tree_round as tree_round_module
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.base import RoundReport, RoundView
from verispec.decoding.policies.tree_budget import AcceptedTable, TreeBudget, VerifyCost
from verispec.proposers.tree_draft import TreeDraftModel

EOS = 7


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(1, scale=3.0)
    return target, perturbed(target, seed=2, noise=0.3)


def lean(model) -> LeanBatch:
    """A one-slot lean Model (it verifies trees) of a transformers model."""
    return LeanBatch(LeanNet(model), slots=1)


def tree_engine(target, draft, k=8, eos=(EOS,), width=3, max_depth=4) -> SpeculativeEngine:
    drafter = TreeDraftModel(lean(draft), target.config.vocab_size, width=width, max_depth=max_depth)
    return SpeculativeEngine(lean(target), drafter, eos_token_ids=eos, k=k,
                             auto_policy=TreeBudget())


def random_tree(rng: random.Random, m: int, vocab: int) -> TokenTree:
    parents, tokens, used = [], [], {}
    for i in range(m):
        parent = rng.randrange(-1, i)
        choices = [t for t in range(vocab) if t not in used.setdefault(parent, set())]
        token = rng.choice(choices)
        used[parent].add(token)
        parents.append(parent)
        tokens.append(token)
    return TokenTree(torch.tensor(tokens), parents)


# -- the tree and the target's tree pass -------------------------------------------------------------------


def test_tree_checks_its_shape():
    with pytest.raises(ValueError, match="sibling"):
        TokenTree(torch.tensor([3, 3]), [ROOT, ROOT])
    with pytest.raises(ValueError, match="come before"):
        TokenTree(torch.tensor([3, 4]), [1, ROOT])
    tree = TokenTree(torch.tensor([5, 6, 7, 8]), [ROOT, ROOT, 0, 2])
    assert tree.depths == [1, 1, 2, 3] and tree.path_to(3) == [0, 2, 3]
    assert tree.paths().int().tolist() == [[0, 0, 0, 0], [1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]]


def test_tree_pass_equals_each_path_run_alone():
    """Every node's logits from one tree-masked pass equal those of its path fed as a plain sequence (fp32), and
    keeping an accepted path leaves the cache as if only the path had been fed: the next token's logits agree."""
    model, rng = tiny_qwen2(3), random.Random(0)
    prompt = torch.tensor([rng.randrange(64) for _ in range(9)])
    for trial in range(6):
        tree = random_tree(rng, rng.randrange(1, 14), 64)
        batch = lean(model)
        one = Sequence(batch)
        one.forward(prompt)
        base = one.length
        logits = batch.forward_tree(0, tree.tokens, base - 1 + torch.tensor(tree.depths), base, tree.paths()[1:],
                                    base - 1 + tree.depth)
        for node in range(len(tree)):
            alone = Sequence(lean(model))
            path = tree.tokens[tree.path_to(node)]
            want = alone.forward(torch.cat([prompt, path]))[-1]
            torch.testing.assert_close(logits[node], want, rtol=1e-4, atol=1e-4)
        leaf = rng.randrange(len(tree))
        path = tree.path_to(leaf)
        batch.compact(0, base, path)
        assert one.length == base + len(path)
        nxt = torch.tensor([rng.randrange(64)])
        alone = Sequence(lean(model))
        want = alone.forward(torch.cat([prompt, tree.tokens[path], nxt]))[-1]
        torch.testing.assert_close(one.forward(nxt)[-1], want, rtol=1e-4, atol=1e-4)


def test_compact_refuses_rows_out_of_order():
    batch = lean(tiny_qwen2(3))
    batch.forward_rows([0], [torch.arange(6)])
    with pytest.raises(ValueError, match="ascending"):
        batch.compact(0, 2, [2, 1])
    with pytest.raises(ValueError, match="ascending"):
        batch.compact(0, 2, [0, 4])
    with pytest.raises(ValueError, match="ascending"):
        batch.compact(0, 7, [])  # a base past what the cache holds


@pytest.mark.parametrize("params", [
    SamplingParams(temperature=0.8, top_p=0.9), SamplingParams(),
    SamplingParams(temperature=1.0, repetition_penalty=1.5, presence_penalty=0.7, frequency_penalty=0.4),
    SamplingParams(repetition_penalty=1.3, frequency_penalty=2.0),
    SamplingParams(temperature=1.0, min_tokens=5, stop_ids=(EOS, 3)),
], ids=["top_p", "greedy", "penalties", "greedy-penalties", "min_tokens"])
def test_tree_rows_see_their_own_path(params):
    """Row i + 1 of a tree's processed rows equals the last row a chain made of node i's path gets (penalties count
    the path's tokens, min_tokens masks by the node's depth), and a chain-shaped tree's rows equal the chain's."""
    rng, vocab = random.Random(1), 16
    seq = TokenSequence([1, 2, EOS, 3], 64, "cpu")
    seq.extend([4, 4, 9], torch.tensor([4, 4, 9]))  # 3 generated tokens: penalties count them
    for _ in range(5):
        tree = random_tree(rng, 9, vocab)
        logits = torch.randn(len(tree) + 1, vocab)
        rows = tree_rows(logits, tree, params, seq)
        torch.testing.assert_close(rows[0], target_rows(logits[:1], tree.tokens[:0], params, seq)[0])
        for node in range(len(tree)):
            path = tree.path_to(node)
            chain = target_rows(torch.cat([logits[:1], logits[[p + 1 for p in path]]]), tree.tokens[path], params, seq)
            torch.testing.assert_close(rows[node + 1], chain[-1])
    chain_tokens = torch.tensor([4, 1, 9, 4, 2])
    logits = torch.randn(6, vocab)
    torch.testing.assert_close(tree_rows(logits, TokenTree.chain(chain_tokens), params, seq),
                               target_rows(logits, chain_tokens, params, seq))


def test_greedy_walk_follows_the_argmax():
    tree = TokenTree(torch.tensor([5, 6, 7, 8]), [ROOT, ROOT, 1, 2])
    assert verify_tree(torch.tensor([6, 0, 7, 8, 3]), tree, True, torch.Generator()) == ([1, 2, 3], 3)
    assert verify_tree(torch.tensor([6, 0, 7, 1, 3]), tree, True, torch.Generator()) == ([1, 2], 1)
    assert verify_tree(torch.tensor([2, 0, 7, 1, 3]), tree, True, torch.Generator()) == ([], 2)


# -- the engine with trees -----------------------------------------------------------------------------------


@pytest.mark.parametrize("k", [1, 3, 8, 20, "auto"])
def test_greedy_tree_generation_equals_plain_decoding(pair, k):
    """Tree rounds of every budget (one node: a chain of one; auto: probes, plain rounds and chosen shapes) give
    plain decoding's tokens (fp32), EOS at any round, prompts of 2-25 tokens, 4-40 new tokens."""
    target, draft = pair
    eng, plain, rng = tree_engine(target, draft, k=k), make_engine(target, None, k=0, eos=(EOS,)), random.Random(5)
    trees = 0
    for _ in range(12):
        prompt = [rng.randrange(64) for _ in range(rng.randrange(2, 25))]
        max_new = rng.randrange(4, 40)
        got = eng.generate(prompt, max_new_tokens=max_new)
        want = plain.generate(prompt, max_new_tokens=max_new)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason, prompt
        trees += got.stats.drafted > 0
    assert trees > 0


def test_greedy_trees_with_stops_and_logprobs(pair):
    """A stop string cut mid-round, stop ids, and logprobs: as plain decoding gives them."""
    target, draft = pair
    eng, plain = tree_engine(target, draft, k=12), make_engine(target, None, k=0, eos=(EOS,))

    def stop(ids):  # stop after the first 11 (a "stop string" of ids), keeping what precedes it
        return next((i for i in range(len(ids)) if ids[i] == 11), None)

    for prompt in ([1, 2, 3], [9, 8, 7, 6, 5], [30, 31]):
        kw = dict(max_new_tokens=30, stop=stop, stop_token_ids=[13], logprobs=3)
        got, want = eng.generate(prompt, **kw), plain.generate(prompt, **kw)
        assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
        for (lp, alts), (lp2, alts2) in zip(got.logprobs, want.logprobs):
            assert lp == pytest.approx(lp2, abs=1e-4)
            assert [a for a, _ in alts] == [a for a, _ in alts2]


def test_draft_cache_holds_the_committed_tokens_after_each_round(pair):
    """After every tree round the draft's cache is a prefix of the committed sequence (its accepted nodes moved
    into place): its next logits equal a fresh draft's fed that prefix."""
    target, draft = pair
    eng = tree_engine(target, draft, k=10)
    drafter = eng.drafter
    cache = Sequence(drafter.model)  # the draft's slot 0
    checked = 0
    for _ in lone_rounds(eng, [5, 9, 13, 2], max_new_tokens=30)[0]:
        held = cache.length
        seq, cached = drafter._held[0]
        assert cached == held
        ids = seq.ids[:held]
        probe = torch.tensor([3])
        got = cache.forward(probe)[-1]
        cache.rollback(held)
        want = Sequence(lean(draft)).forward(torch.tensor(ids + [3]))[-1]
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        checked += held > 4  # the cache holds more than the prompt: accepted nodes were kept
    assert checked > 2


def test_trees_accept_more_than_a_chain_of_their_depth(pair):
    """A tree of depth 4 accepts more per round than a chain of 4 drafts from the same draft (here 2.26 vs 1.78
    tokens per round): its runner-up candidates catch tokens the chain's one guess misses."""
    target = pair[0]
    draft = perturbed(target, seed=2, noise=0.1)
    prompts = [[i, i + 3, i + 7] for i in range(8)]
    chain = make_engine(target, draft, k=4, eos=())
    tree = tree_engine(target, draft, k=16, eos=(), width=3, max_depth=4)
    chain_len = sum(chain.generate(p, max_new_tokens=40).stats.mean_accepted_length for p in prompts)
    tree_len = sum(tree.generate(p, max_new_tokens=40).stats.mean_accepted_length for p in prompts)
    assert tree_len > 1.15 * chain_len


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


def _tree_histograms(target, draft, params, n, steps, seed0):
    counts = torch.zeros(steps, target.config.vocab_size, dtype=torch.long)
    eng = tree_engine(target, draft, k=14, eos=(), width=2, max_depth=3)  # the whole pool: 2 + 4 + 4 nodes
    depths = set()
    for i in range(n):
        out = eng.generate([3, 1, 2], SamplingParams(**{**params.__dict__, "seed": seed0 + i}), max_new_tokens=steps)
        depths.update(a for a in out.stats.accepted_lengths)
        for pos, tok in enumerate(out.token_ids):
            counts[pos, tok] += 1
    return counts, depths


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.9),
                                    SamplingParams(temperature=1.0, repetition_penalty=1.6, frequency_penalty=0.5)],
                         ids=["temperature", "top_p", "penalties"])
def test_tree_marginals_match_target(small_vocab_pair, params):
    """Tokens 1-5 of tree-speculative generations (token 1 from the prefill, then a tree of 2 children per node,
    depth 3: a token at every depth and the bonus after depth 3) follow the target's exact marginals (V = 8,
    N = 3000; false-failure probability 5 x ALPHA). Every accepted length 0..3 occurs (0..2 under top-p)."""
    target, draft = small_vocab_pair
    steps = 5
    exact = _exact_marginals(target, [3, 1, 2], params, steps)
    counts, depths = _tree_histograms(target, draft, params, n=3000, steps=steps, seed0=0)
    assert depths >= ({0, 1, 2, 3} if params.top_p == 1.0 else {0, 1, 2})  # top-p: fewer candidates survive
    for pos in range(steps):
        assert chi2_pvalue(counts[pos], exact[pos]) > ALPHA, pos


def test_tree_negative_control_fails(small_vocab_pair, monkeypatch):
    """The single-chain rule applied to each child in turn (accept child c with min(1, p(c)/q(c)), q one-hot,
    without removing the rejected children from p; recover from the last child's residual) must fail the same test."""
    target, draft = small_vocab_pair

    def chain_rule_on_a_tree(rows, tree, greedy, rng):
        path, row = [], 0
        while True:
            p = rows[row]
            kids = tree.children[row]
            child = None
            for token, node in kids.items():
                if float(torch.rand(1, generator=rng)) < float(p[token]):
                    child = node
                    break
            if child is None:
                residual = p.clone()
                if kids:
                    residual[list(kids)[-1]] = 0
                return path, int(sample((residual / residual.sum())[None], rng))
            path.append(child)
            row = child + 1

    monkeypatch.setattr(tree_round_module, "verify_tree", chain_rule_on_a_tree)
    params = SamplingParams(temperature=1.0)
    counts, _ = _tree_histograms(target, draft, params, n=1500, steps=4, seed0=0)  # token 1 from the prefill
    exact = _exact_marginals(target, [3, 1, 2], params, 4)
    assert min(chi2_pvalue(counts[pos], exact[pos]) for pos in range(4)) < ALPHA


def test_seeded_tree_sampling_reproduces(pair):
    target, draft = pair
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=77)
    a = tree_engine(target, draft, k=10).generate([4, 5, 6], params, max_new_tokens=30).token_ids
    b = tree_engine(target, draft, k=10).generate([4, 5, 6], params, max_new_tokens=30).token_ids
    assert a == b


# -- the budget policy --------------------------------------------------------------------------------


def test_verify_cost_is_robust_and_keeps_cheap_counts():
    """A slow outlier does not decide a count (the median of its recent passes does); a count that measured
    cheaper than a smaller one stays cheaper (no monotone fit blurs it); unmeasured counts interpolate."""
    cost = VerifyCost()
    cost.observe(1, 0.10)
    for n, seconds in ((5, 0.20), (13, 0.50), (17, 0.25)):
        for _ in range(4):
            cost.observe(n, seconds)
    cost.observe(5, 2.0)  # an outlier
    assert cost.plain == pytest.approx(0.10) and cost.seconds(5) == pytest.approx(0.20)
    assert cost.seconds(17) < cost.seconds(13)
    assert cost.seconds(9) == pytest.approx(0.35) and cost.seconds(33) == pytest.approx(0.25)
    assert VerifyCost().seconds(4) is None


def test_accepted_table_measures_every_smaller_tree():
    """A verified tree says what its best-scored n nodes of depth <= d would have accepted."""
    #        root -> a (0.6) -> c (0.3) -> e (0.2)
    #             -> b (0.3) -> d (0.25)
    tree = TokenTree(torch.tensor([1, 2, 3, 4, 5]), [ROOT, ROOT, 0, 1, 2], [0.6, 0.3, 0.3, 0.25, 0.2])
    table = AcceptedTable(max_depth=3, max_nodes=5, decay=0.5)
    table.observe(tree, (1, 3), depth=3)  # b, d accepted
    assert table.expected(3, 1) == 0.0  # a alone: nothing accepted
    assert table.expected(3, 2) == 1.0  # a, b (c ties b, deeper): b
    assert table.expected(3, 3) == 1.0 and table.expected(3, 4) == 2.0  # d is the 4th best
    assert table.expected(3, 5) == 2.0
    assert table.expected(1, 2) == 1.0 and table.expected(1, 3) is None  # depth 1 has two nodes
    assert table.expected(2, 4) == 2.0


def _plain_report(seconds):
    return RoundReport(k=0, source="", drafted=0, accepted=0, fed=1, first=False, own_draft=False, draft_steps=0,
                       draft_seconds=0.0, verify_seconds=seconds, catchup_seconds=0.0, catchup_tokens=0,
                       seconds=seconds)


def _report(tree, path, verify_seconds, draft_seconds=0.02, steps=4):
    return RoundReport(k=len(tree), source="tree", drafted=len(tree), accepted=len(path), fed=len(tree) + 1,
                       first=False, own_draft=False, draft_steps=steps, draft_seconds=draft_seconds,
                       verify_seconds=verify_seconds, catchup_seconds=0.0, catchup_tokens=0,
                       seconds=draft_seconds + verify_seconds, tree=tree, path=tuple(path))


def test_budget_policy_drafts_trees_only_where_they_pay():
    seq = TokenSequence([1, 2, 3], 64, "cpu")
    view = RoundView(seq, 50, "tree", 0, lambda: None)
    tree = TokenTree(torch.tensor([1, 2, 3, 4]), [ROOT, 0, 1, 2], [0.9, 0.8, 0.7, 0.6])
    for accepted, verify, expect_tree in ((4, 0.12, True), (0, 0.40, False)):
        policy = TreeBudget(max_nodes=4, max_depth=4, probe_every=1000)
        assert policy.choose(view).k == 0  # a plain round first: the pass trees are weighed against
        policy.observe(_plain_report(0.10))
        first = policy.choose(view)
        assert (first.k, first.depth) == (4, 4)  # nothing measured yet: the largest tree probes
        for _ in range(5):
            policy.observe(_report(tree, list(range(accepted)), verify))
        plan = policy.choose(view)
        assert (plan.k > 0) == expect_tree
        if expect_tree:
            assert (plan.k, plan.depth) == (4, 4)  # all four nodes pay


def test_budget_policy_caps_depth_and_probes():
    """Near the end of a generation the depth is capped by the tokens left; every probe_every rounds the largest
    tree probes, half-way between a plain round re-measures plain decoding."""
    seq = TokenSequence([1, 2, 3], 64, "cpu")
    tree = TokenTree(torch.tensor([1, 2, 3, 4]), [ROOT, 0, 1, 2], [0.9, 0.8, 0.7, 0.6])
    policy = TreeBudget(max_nodes=4, max_depth=4, probe_every=4)
    policy.observe(_plain_report(0.10))
    for _ in range(5):
        policy.observe(_report(tree, [0, 1, 2, 3], 0.12))
    plans = [policy.choose(RoundView(seq, 50, "tree", 0, lambda: None)) for _ in range(8)]
    assert [p.k for p in plans] == [4, 0, 4, 4, 4, 0, 4, 4]  # round 2 and 6: plain; 4 and 8: probes
    assert all(p.depth == 4 for p in plans if p.k)
    near_end = policy.choose(RoundView(seq, 2, "tree", 0, lambda: None))
    assert near_end.k and near_end.depth <= 2


# -- the library and the command line ----------------------------------------------------------------------


def test_load_with_the_tree_drafter_matches_plain_greedy():
    target, draft, tok = text_pair()
    pipe = verispec.load(target, draft, tokenizer=tok, drafter="tree", draft_quant="none")
    plain = verispec.load(target, None, tokenizer=tok, drafter=None)
    assert pipe.k == "auto" and "token trees do not batch" in pipe.batch_reason
    for prompt in ("hello there", "def f(x):"):
        assert pipe.generate(prompt, max_new_tokens=24).token_ids == plain.generate(prompt, max_new_tokens=24).token_ids


def test_tree_flags_refuse_what_they_cannot_do(capsys):
    from verispec.apps.cli import main

    assert main(["generate", "--prompt", "x", "--tree", "--drafter", "ngram"]) == 2
    assert "--tree drafts with the draft model" in capsys.readouterr().err
    assert main(["generate", "--prompt", "x", "--tree-budget", "8", "-k", "4"]) == 2
    assert "pass one of them" in capsys.readouterr().err
    assert main(["bench", "--tree", "--tree-budget", "0"]) == 2
    assert "--tree-budget needs values >= 1" in capsys.readouterr().err


def test_server_serves_trees_one_at_a_time():
    """`serve --tree`: a greedy completion equals plain decoding's; /v1/models names the tree drafter and why it
    serves one request at a time."""
    import asyncio

    import httpx

    from verispec.apps.server.app import ServerSettings, create_app

    target, draft, tok = text_pair()
    pipe = verispec.load(target, draft, tokenizer=tok, drafter="tree", draft_quant="none")
    want = verispec.load(target, None, tokenizer=tok, drafter=None).generate("def f(x):", max_new_tokens=16).text
    app = create_app(pipe, ServerSettings(model_names=("tiny",), max_batch=4))

    async def scenario():
        transport = httpx.ASGITransport(app=app)
        async with app.router.lifespan_context(app), httpx.AsyncClient(transport=transport,
                                                                       base_url="http://127.0.0.1") as client:
            r = await client.post("/v1/completions", json={"model": "tiny", "prompt": "def f(x):", "max_tokens": 16,
                                                           "temperature": 0, "drafter": "tree"})
            models = await client.get("/v1/models")
            return r.json(), models.json()

    completion, models = asyncio.run(scenario())
    assert completion["choices"][0]["text"] == want
    mine = next(m for m in models["data"] if m.get("verispec"))["verispec"]
    assert mine["drafter"] == "tree" and "token trees do not batch" in mine["batching"]
