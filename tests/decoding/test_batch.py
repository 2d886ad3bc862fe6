"""Batched speculative decoding (verispec.decoding.engine with n slots): every sequence exact on its own, whatever its
batch mates; an n-slot engine gives each request what a 1-slot engine gives it."""

from __future__ import annotations

import math
import random

import pytest
import torch
from stats_util import chi2_pvalue
from test_engine import ALPHA, _exact_marginals
from tiny import make_engine, perturbed, text_pair, tiny_qwen2

import verispec
from verispec.backends import lean as lean_module
from verispec.backends.base import Sequence
from verispec.backends.lean import LeanBatch, LeanNet
from verispec.core.sampling import SamplingParams
from verispec.decoding import engine as engine_module
from verispec.decoding.engine import SpeculativeEngine
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.decoding.request import Request
from verispec.proposers import DraftModel, LookupDrafter, NgramProposer

EOS = 7


@pytest.fixture(scope="module")
def pair():
    target = tiny_qwen2(1, scale=3.0)
    return target, perturbed(target, seed=2, noise=0.3)


def make_batch(target, draft, slots, k=4, eos=(EOS,), drafter="model") -> SpeculativeEngine:
    """An engine of `slots` slots on the lean path (target and draft each a LeanBatch of that many slots)."""
    drafter_ = None
    if drafter == "model":
        drafter_ = DraftModel(LeanBatch(LeanNet(draft), slots), target.config.vocab_size)
    elif drafter == "ngram":
        drafter_ = LookupDrafter([NgramProposer(max_ngram=3, min_ngram=1) for _ in range(slots)])
    return SpeculativeEngine(LeanBatch(LeanNet(target), slots), drafter_, eos_token_ids=eos, k=k,
                             auto_policy=CostAwareK())


def run_all(batch, reqs):
    """Every request through the batch, the next admitted as soon as a slot frees; the results in order.
    Requests are keyword dicts of Request's fields ('stop': a stop test)."""
    waiting, index_of = list(enumerate(reqs)), {}
    while waiting or batch.active:
        while waiting and batch.free_slots:
            index, r = waiting.pop(0)
            index_of[batch.add(Request(**{k: v for k, v in r.items() if k != "stop"}), stop=r.get("stop"))] = index
        batch.step()
    results = [None] * len(reqs)
    for row, index in index_of.items():
        results[index] = row.result
    return results


def plain_greedy(target, prompt, max_new, eos=(EOS,)):
    return make_engine(target, None, k=0, eos=eos).generate(prompt, max_new_tokens=max_new).token_ids


def requests(n, seed):
    """n requests of mixed prompt length, k and max_new_tokens."""
    rng = random.Random(seed)
    return [dict(prompt_ids=[rng.randrange(64) for _ in range(rng.randrange(2, 25))], max_new_tokens=rng.randrange(4, 30),
                 k=rng.choice([0, 1, 2, 3, 4, 6])) for _ in range(n)]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_lean_batch_rows_match_one_sequence(monkeypatch, layout):
    """Ragged rows in one forward (prefills of different lengths, then 1-4 new tokens each, slots out of
    order, a slot moved), padded to one length or packed side by side: each row's logits equal its sequence
    run alone (fp32). Uninitialised memory is NaN here: a row's masked positions must never bring it in
    (attention weighs them 0, and 0 * NaN = NaN)."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, **kw: empty(*a, **kw).fill_(math.nan))
    monkeypatch.setattr(lean_module, "PACKED_WHEN_PADDING", 0 if layout == "padded" else 10**6)
    model = tiny_qwen2(3)
    solo, batch = Sequence(LeanBatch(LeanNet(model), 1)), LeanBatch(LeanNet(model), 4)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen) for n in (5, 9, 3, 12)]
    for slot, prompt in enumerate(prompts):
        batch.forward_rows([slot], [prompt])
    feeds = [torch.randint(0, 64, (n,), generator=gen) for n in (1, 3, 2, 4)]
    batch.rollback(1, 7)  # a ragged rollback: slot 1 drops two prompt tokens
    got = batch.forward_rows([2, 0, 3, 1], [feeds[2], feeds[0], feeds[3], feeds[1]])
    for slot, logits in zip([2, 0, 3, 1], got):
        solo.reset()
        solo.forward(prompts[slot][:7] if slot == 1 else prompts[slot])
        torch.testing.assert_close(logits, solo.forward(feeds[slot]), atol=1e-5, rtol=1e-4)
    batch.swap(3, 0)  # slot 0 now holds slot 3's sequence, slot 3 slot 0's
    assert batch.lengths[0] == 12 + 4 and batch.lengths[3] == 5 + 1
    last = batch.forward_rows([0, 1, 3], [feeds[0][:1], feeds[1][:2], feeds[2][:1]], last_only=True)
    solo.reset()
    solo.forward(torch.cat([prompts[3], feeds[3]]))
    torch.testing.assert_close(last[0], solo.forward(feeds[0][:1]), atol=1e-5, rtol=1e-4)
    solo.reset()
    solo.forward(torch.cat([prompts[0], feeds[0]]))
    torch.testing.assert_close(last[2], solo.forward(feeds[2][:1]), atol=1e-5, rtol=1e-4)
    batch.rollback(3, 5 + 1)
    assert last[1].shape == (1, 64) and batch.lengths[:2] == [17, 7 + 3 + 2]
    part = batch.forward_rows([0, 1, 2], [feeds[3], feeds[1][:1], feeds[2]], logits_for=[2, 1, 0])  # last 2, 1, none
    assert [p.shape[0] for p in part] == [2, 1, 0]
    solo.reset()
    solo.forward(torch.cat([prompts[3], feeds[3], feeds[0][:1]]))
    torch.testing.assert_close(part[0], solo.forward(feeds[3])[-2:], atol=1e-5, rtol=1e-4)
    solo.reset()
    solo.forward(torch.cat([prompts[1][:7], feeds[1], feeds[1][:2]]))
    torch.testing.assert_close(part[1], solo.forward(feeds[1][:1]), atol=1e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="keeps at most"):
        batch.forward_rows([0, 1], [feeds[0], feeds[1]], logits_for=[1])


def test_lean_batch_packs_ragged_rows():
    """A row of a prompt beside rows of one token: packed (the linears see 12 token rows, not 3 x 10)."""
    model = tiny_qwen2(3)
    batch = LeanBatch(LeanNet(model), 3)
    seen = []
    batch.net.layers[0].qkv.register_forward_hook(lambda mod, args, out: seen.append(tuple(args[0].shape[:2])))
    batch.forward_rows([0, 1, 2], [torch.arange(1), torch.arange(10), torch.arange(1)])
    assert seen == [(1, 12)]


@pytest.mark.parametrize("size", [1, 2, 3, 4, 5, 6])
def test_greedy_batch_identical_to_plain_decoding(pair, size):
    """B sequences of mixed prompt lengths, k (0 to 6) and lengths, some ending at EOS in different rounds:
    each one's tokens equal plain greedy decoding of it alone."""
    target, draft = pair
    reqs = requests(size, seed=size)
    reqs[0]["max_new_tokens"] = 30
    eos = plain_greedy(target, reqs[0]["prompt_ids"], 30, eos=())[5]  # the first sequence stops at its 6th token
    batch = make_batch(target, draft, size, eos=(eos,))
    results = run_all(batch, reqs)
    for req, result in zip(reqs, results):
        assert result.token_ids == plain_greedy(target, req["prompt_ids"], req["max_new_tokens"], eos=(eos,)), req
    assert not batch.active and batch.free_slots == size
    assert results[0].finish_reason == "stop" and len(results[0].token_ids) <= 6
    if size >= 4:
        assert "length" in {r.finish_reason for r in results}  # sequences left the batch for both reasons


@pytest.mark.parametrize("drafter", ["model", "ngram", "none"])
def test_requests_joining_a_running_batch(pair, drafter):
    """9 requests through 3 slots: each joins as a slot frees, into a batch mid-generation; all exact."""
    target, draft = pair
    reqs = requests(9, seed=11)
    batch = make_batch(target, draft, 3, drafter=drafter)
    for req, result in zip(reqs, run_all(batch, reqs)):
        assert result.token_ids == plain_greedy(target, req["prompt_ids"], req["max_new_tokens"])


def _record_target_passes(batch: SpeculativeEngine) -> list[tuple[list[int], list[int]]]:
    """(rows' feed sizes, rows' kept logits) of every target pass the batch makes from now on."""
    passes, real = [], batch.target.forward_rows

    def recording(slots, feeds, last_only=False, logits_for=None):
        passes.append(([f.numel() for f in feeds], logits_for))
        return real(slots, feeds, last_only, logits_for)

    batch.target.forward_rows = recording
    return passes


def test_a_joining_prompt_is_prefilled_in_the_rounds_shared_pass(pair):
    """Requests that join cost no target pass of their own: the next round's one pass feeds each its prompt
    (a draft model drafts from a request's second round on), beside a running row's last token and drafts; all
    stay exact."""
    target, draft = pair
    batch = make_batch(target, draft, 3, k=2, eos=())
    passes = _record_target_passes(batch)
    running = batch.add([4, 5, 6], max_new_tokens=12)
    batch.step()
    assert passes == [([3], [1])]
    joiners = [batch.add(list(range(1, 9)), max_new_tokens=12), batch.add([9, 8, 7, 6, 5], max_new_tokens=12)]
    assert len(passes) == 1  # add() feeds nothing
    batch.step()
    assert passes[1] == ([1 + 2, 8, 5], [3, 1, 1])
    batch.step()
    assert passes[2] == ([1 + 2, 1 + 2, 1 + 2], [3, 3, 3])  # every row drafts now
    while batch.active:
        batch.step()
    for request in (running, *joiners):
        assert request.result.token_ids == plain_greedy(target, request.request.prompt_ids, 12, eos=())


@pytest.mark.parametrize("chunk", [1, 3, 7])
def test_long_prompts_are_prefilled_in_parts_while_others_decode(pair, chunk):
    """A round feeds at most `prefill_chunk` prompt tokens over all rows: a long prompt takes several rounds
    (its parts fed with no logits kept), the running rows commit in each of them, and every row is exact."""
    target, draft = pair
    reqs = requests(7, seed=3)
    reqs[1]["prompt_ids"] = [(3 * i) % 64 for i in range(23)]
    batch = make_batch(target, draft, 3)
    batch.prefill_chunk = chunk
    passes = _record_target_passes(batch)
    results = run_all(batch, reqs)
    for req, result in zip(reqs, results):
        assert result.token_ids == plain_greedy(target, req["prompt_ids"], req["max_new_tokens"]), req
    parts = [(sizes, keep) for sizes, keep in passes if 0 in keep]
    assert len(parts) >= 23 // chunk - 1
    long = results[1].stats  # its parts' passes are booked, and its prefill ends before its first token
    assert long.target_forwards > long.rounds and 0 < long.prefill_seconds <= long.first_token_seconds
    for sizes, keep in passes:  # prompt tokens fed: a part (no logits), or a prompt's rest ahead of its drafts
        unseen = [size if k == 0 else size - k + 1 for size, k in zip(sizes, keep)]
        assert sum(n for n in unseen if n > 1) <= max(chunk, 1), (sizes, keep)
    assert any(len(sizes) > 1 for sizes, _ in parts)  # others decoded beside a prompt's parts


def test_a_half_fed_prompt_moves_and_is_cancelled_cleanly(pair):
    """A prompt fed in parts keeps its place when its row moves into a freed slot, and a row cancelled half
    fed leaves nothing behind for the request that takes its slot: all exact."""
    target, draft = pair
    batch = make_batch(target, draft, 3, k=2, eos=())
    batch.prefill_chunk = 4
    first, second = batch.add([1, 2, 3], max_new_tokens=10), batch.add([4, 5], max_new_tokens=10)
    long = batch.add(list(range(10, 30)), max_new_tokens=10)
    while not 0 < batch.target.lengths[long.slot] < 19:
        batch.step()
    fed = batch.target.lengths[long.slot]
    batch.cancel(first)
    assert long.slot == 0 and batch.target.lengths[0] == fed
    cancelled = batch.add(list(range(30, 50)), max_new_tokens=10)
    while batch.target.lengths[cancelled.slot] == 0:
        batch.step()
    batch.cancel(cancelled)
    last = batch.add([7, 7, 8], max_new_tokens=10)
    while batch.active:
        batch.step()
    for request in (second, long, last):
        assert request.result.token_ids == plain_greedy(target, request.request.prompt_ids, 10, eos=())
    assert cancelled.result.token_ids == []


def test_cancel_mid_batch_leaves_the_others_exact(pair):
    """Cancel the second of four sequences after two rounds (its slot is refilled by moving the last one):
    the other three finish exactly; the cancelled one keeps a prefix of its own output."""
    target, draft = pair
    reqs = [dict(prompt_ids=[1, 2, 3, i], max_new_tokens=25, k=2 + i % 3) for i in range(4)]
    batch = make_batch(target, draft, 4, eos=())
    handles = [batch.add(Request(**req)) for req in reqs]
    batch.step()
    batch.step()
    batch.cancel(handles[1])
    assert handles[1].done and handles[3].slot == 1 and len(batch.active) == 3
    while batch.active:
        batch.step()
    for i, (req, handle) in enumerate(zip(reqs, handles)):
        alone = plain_greedy(target, req["prompt_ids"], 25, eos=())
        if i == 1:
            assert 0 < len(handle.result.token_ids) < 25 and handle.result.token_ids == alone[: len(handle.result.token_ids)]
        else:
            assert handle.result.token_ids == alone


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_a_resent_request_finds_its_prefix_in_whichever_slot_kept_it(pair, drafter):
    """Editors cancel a stale request and send it again, longer: the cancelled row leaves a slot in the middle of
    the batch, its cache kept in a free slot (the last row swaps into its place), and the resent request is admitted
    into that slot, its prompt's common prefix already cached (target and draft): the answer is plain decoding's."""
    target, draft = pair
    batch = make_batch(target, draft, 4, eos=())
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, i] for i in range(3)]
    rows = [batch.add(Request(prompt_ids=p, max_new_tokens=40, k=3)) for p in prompts]
    batch.step()
    batch.step()
    batch.cancel(rows[0])  # the first row leaves; the last one takes its slot
    assert rows[2].slot == 0 and len(batch.active) == 2
    resent = prompts[0] + rows[0].result.token_ids[:2] + [21, 22]
    again = batch.add(Request(prompt_ids=resent, max_new_tokens=12, k=3))
    held = len(prompts[0]) + len(rows[0].result.token_ids) - 1  # a slot caches all but the last committed token
    assert again.result.stats.cached_tokens == min(held, len(prompts[0]) + 2) >= len(prompts[0])
    fresh = batch.add(Request(prompt_ids=[30, 31, 32], max_new_tokens=12, k=3))
    assert fresh.result.stats.cached_tokens == 0
    while batch.active:
        batch.step()
    assert again.result.token_ids == plain_greedy(target, resent, 12, eos=())
    for row, prompt in zip(rows[1:], prompts[1:]):
        assert row.result.token_ids == plain_greedy(target, prompt, 40, eos=())


@pytest.mark.parametrize("chunk", [512, 16])
def test_rows_of_one_prompt_compute_it_once(pair, chunk):
    """n choices of one prompt (seeded, sampled) and a request of the same 36-token system prompt with its own
    tail: the oldest row feeds the prompt (in parts when the chunk is small) while the others wait, then they
    copy what its cache holds and feed only the rest; every row draws what it draws alone."""
    target, draft = pair
    system = [(5 * i + 3) % 64 for i in range(36)]
    reqs = [dict(prompt_ids=system + [9, 9, 9], params=SamplingParams(temperature=1.0, seed=s), max_new_tokens=16,
                 k=3) for s in range(3)]
    reqs.append(dict(prompt_ids=system + [1, 2, 3, 4, 5, 6], max_new_tokens=16, k=2))
    alone = [run_all(make_batch(target, draft, 1), [req])[0].token_ids for req in reqs]
    batch = make_batch(target, draft, 4)
    batch.prefill_chunk = chunk
    passes = _record_target_passes(batch)
    results = run_all(batch, reqs)
    assert [r.token_ids for r in results] == alone
    assert [r.stats.cached_tokens for r in results] == [0, 38, 38, 36]
    fed = [size if k == 0 else size - k + 1 for sizes, keep in passes for size, k in zip(sizes, keep)]
    assert sum(n for n in fed if n > 1) == 39 + 6  # the prompt once, the fourth row's own tail (the choices
    # feed only their prompt's last token, as a decoding row feeds its last)


def test_stops_and_logprobs_per_row(pair):
    """A stop callback and logprobs on one row of a batch: the same as that request alone."""
    target, draft = pair
    stop = lambda ids: next((i + 1 for i, t in enumerate(ids) if t == 5), None)  # noqa: E731
    solo = make_engine(target, draft, k=3, eos=(EOS,))
    alone = solo.generate([4, 4, 9], max_new_tokens=20, stop=stop, logprobs=2)
    batch = make_batch(target, draft, 3, k=3)
    results = run_all(batch, [dict(prompt_ids=[1, 2], max_new_tokens=12),
                         dict(prompt_ids=[4, 4, 9], max_new_tokens=20, stop=stop, logprobs=2),
                         dict(prompt_ids=[3] * 10, max_new_tokens=9)])
    got = results[1]
    assert got.token_ids == alone.token_ids and got.finish_reason == alone.finish_reason
    assert [entry[1][0][0] for entry in got.logprobs] == [entry[1][0][0] for entry in alone.logprobs]
    for (lp, top), (lp2, top2) in zip(got.logprobs, alone.logprobs):
        assert lp == pytest.approx(lp2, abs=1e-4)


def test_a_failed_round_leaves_a_clean_batch(pair, monkeypatch):
    """A round that fails half-way (the second row's settling raises after the first row's settled it as finished):
    cancel still takes every row out (also one already marked done), abort empties the batch, and it decodes
    exactly again."""
    target, draft = pair
    batch = make_batch(target, draft, 2, eos=())
    first = batch.add([1, 2], max_new_tokens=1)  # finishes in its first round
    second = batch.add([3, 4], max_new_tokens=10)
    real, calls = engine_module.settle, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom")
        return real(*args)

    monkeypatch.setattr(engine_module, "settle", failing)
    with pytest.raises(RuntimeError, match="boom"):
        batch.step()
    assert first.done  # marked done by its round, still holding its slot
    batch.cancel(first)
    assert batch.active == [second] and second.slot == 0
    batch.abort()
    assert not batch.active and batch.free_slots == 2 and second.done
    monkeypatch.undo()
    reqs = requests(3, seed=5)
    for req, result in zip(reqs, run_all(batch, reqs)):
        assert result.token_ids == plain_greedy(target, req["prompt_ids"], req["max_new_tokens"], eos=())


def test_bad_requests_and_a_full_batch(pair):
    target, draft = pair
    batch = make_batch(target, draft, 1)
    with pytest.raises(ValueError, match="prompt is empty"):
        batch.add([])
    with pytest.raises(ValueError, match="k must be an integer >= 0"):
        batch.add([1], k=-1)
    batch.add([1, 2])
    with pytest.raises(RuntimeError, match="batch is full"):
        batch.add([1, 2])


# -- sampling: each row's distribution is the target's ------------------------------------------------


@pytest.fixture(scope="module")
def small_vocab_pair():
    target = tiny_qwen2(11, vocab_size=8, hidden=32, init=0.5)
    return target, perturbed(target, seed=12, noise=0.5)


ROW_PARAMS = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=5), SamplingParams(temperature=1.0)]
ROW_PROMPTS = [[3, 1, 2], [5, 5], [1, 2, 3, 4, 6, 0]]


def _batch_histograms(target, draft, n, steps, seed0):
    """Tokens 1..steps of each of three rows decoded together (k = 2, 1, 3; their own settings and seeds)."""
    counts = torch.zeros(len(ROW_PARAMS), steps, 8, dtype=torch.long)
    batch = make_batch(target, draft, 3, k=2, eos=())
    for i in range(n):
        reqs = [dict(prompt_ids=p, params=SamplingParams(**{**params.__dict__, "seed": seed0 + 3 * i + r}),
                     max_new_tokens=steps, k=k)
                for r, (p, params, k) in enumerate(zip(ROW_PROMPTS, ROW_PARAMS, (2, 1, 3)))]
        for r, result in enumerate(run_all(batch, reqs)):
            for pos, tok in enumerate(result.token_ids):
                counts[r, pos, tok] += 1
    return counts


def test_batch_marginals_match_target_per_row(small_vocab_pair):
    """Three rows with different settings, prompts and k, sampled together 2000 times: tokens 1-4 of each row
    (the first from the prefill's pass, then drafts) follow that row's exact target marginals (false-failure
    probability 12 x ALPHA)."""
    target, draft = small_vocab_pair
    counts = _batch_histograms(target, draft, n=2000, steps=4, seed0=0)
    for r, (prompt, params) in enumerate(zip(ROW_PROMPTS, ROW_PARAMS)):
        exact = _exact_marginals(target, prompt, params, 4)
        for pos in range(4):
            assert chi2_pvalue(counts[r, pos], exact[pos]) > ALPHA, (r, pos)


def test_batch_negative_control_fails(small_vocab_pair, monkeypatch):
    """The same test with a verifier that accepts every draft must fail."""
    target, draft = small_vocab_pair

    def always_accept(draft_tokens, draft_probs, target_probs, rng):
        k = draft_tokens.shape[1]
        bonus = torch.multinomial(target_probs[:, k], 1, generator=rng).squeeze(-1)
        return torch.full((draft_tokens.shape[0],), k), bonus

    monkeypatch.setattr("verispec.core.rows.rejection_sample", always_accept)
    counts = _batch_histograms(target, draft, n=1500, steps=3, seed0=0)
    exact = _exact_marginals(target, ROW_PROMPTS[0], ROW_PARAMS[0], 3)  # token 1 from the prefill, 2 drafted
    assert min(chi2_pvalue(counts[0, pos], exact[pos]) for pos in range(3)) < ALPHA


def test_seed_reproduces_whatever_the_batch_mates(pair):
    """A seeded sampled request with a fixed k: the same tokens alone in the batch and among three others
    (other prompts, settings and seeds), and when it joins a batch already running."""
    target, draft = pair
    mine = dict(prompt_ids=[2, 9, 4], params=SamplingParams(temperature=0.9, top_p=0.9, seed=123), max_new_tokens=24,
                k=3)
    alone = run_all(make_batch(target, draft, 1), [mine])[0].token_ids
    mates = [dict(prompt_ids=[i, i + 1], params=SamplingParams(temperature=1.2, seed=i), max_new_tokens=10 + i)
             for i in range(3)]
    assert run_all(make_batch(target, draft, 4), [mates[0], mine, *mates[1:]])[1].token_ids == alone
    assert run_all(make_batch(target, draft, 2), [*mates, mine])[3].token_ids == alone  # joins mid-way
    chunked = make_batch(target, draft, 3)
    chunked.prefill_chunk = 2  # its prompt fed in parts that depend on the mates ahead of it
    assert run_all(chunked, [*mates, mine])[3].token_ids == alone


# -- the library -------------------------------------------------------------------------------------


def test_pipeline_generates_a_list_of_prompts():
    """pipe.generate([...]) returns one Completion per prompt, each equal to its own generate (greedy): decoded
    together where the pipeline batches (a draft model, a hybrid drafter), one at a time where it cannot (trees)."""
    target, draft, tok = text_pair()
    pipe = verispec.load(target, draft, tokenizer=tok, k=3)
    assert pipe.batch_reason is None
    prompts = ["def add(a, b):", [{"role": "user", "content": "hi"}], "x = 1\ny = 2\n", list(range(40, 60))]
    batched = pipe.generate(prompts, max_new_tokens=20, max_batch=3)
    assert len(batched) == 4
    for prompt, completion in zip(prompts, batched):
        single = pipe.generate(prompt, max_new_tokens=20)
        assert (completion.token_ids, completion.text) == (single.token_ids, single.text)
    hybrid = verispec.load(target, tokenizer=tok, drafter="hybrid", draft=draft)
    assert hybrid.batch_reason is None
    assert [c.token_ids for c in hybrid.generate(prompts[:2], max_new_tokens=8)] == \
        [hybrid.generate(p, max_new_tokens=8).token_ids for p in prompts[:2]]
    tree = verispec.load(target, draft, tokenizer=tok, drafter="tree", draft_quant="none")
    assert "token trees do not batch" in tree.batch_reason
    assert [c.token_ids for c in tree.generate(prompts[:2], max_new_tokens=8)] == \
        [tree.generate(p, max_new_tokens=8).token_ids for p in prompts[:2]]


def test_seed_reproduces_with_a_quantised_draft_among_many_mates():
    """An int4 draft: a batch's draft step has more rows than the packed kernels' few, and must still compute
    each row as it would alone (the packed kernels do; the bf16 fallback would change q, and the draws). A
    near-uniform model, where any change of q changes the seeded draws."""
    from verispec.backends.quant import quantize_model

    target, draft, _ = text_pair()
    net = LeanNet(draft)
    quantize_model(net, "int4")

    def batch(slots):
        return SpeculativeEngine(LeanBatch(LeanNet(target), slots), DraftModel(LeanBatch(net, slots), 264),
                                 eos_token_ids=(), k=3)

    mine = dict(prompt_ids=[5, 6, 7], params=SamplingParams(temperature=1.0, seed=9), max_new_tokens=24)
    alone = run_all(batch(1), [mine])[0].token_ids
    mates = [dict(prompt_ids=[i + 1] * (i + 2), params=SamplingParams(temperature=0.0), max_new_tokens=30)
             for i in range(5)]
    assert run_all(batch(6), [*mates, mine])[5].token_ids == alone


def test_seed_reproduces_whatever_ran_before_in_the_slots():
    """Seeded requests sent again (three samples of one prompt, as /infill's n_cmpl sends them), their prompt
    already in the slots' caches, draw what they drew first: an int4 draft computes a prompt's last tokens after a
    cached prefix a few bits apart from the whole prompt, so a seeded sampled request prefills the draft anew (the
    others keep the draft's cached prefix). A near-uniform model, where any change of q changes the seeded draws."""
    from verispec.backends.quant import quantize_model

    target, draft, _ = text_pair()
    net = LeanNet(draft)
    quantize_model(net, "int4")
    engine = SpeculativeEngine(LeanBatch(LeanNet(target), 4), DraftModel(LeanBatch(net, 4), 264),
                               eos_token_ids=(), k=4)
    reqs = [dict(prompt_ids=list(range(40, 100)), params=SamplingParams(temperature=1.0, seed=7 + i),
                 max_new_tokens=16) for i in range(3)]
    first = run_all(engine, reqs)
    assert [r.stats.cached_tokens for r in first] == [0, 59, 59]  # one prompt, computed once
    again = run_all(engine, reqs)
    assert [r.token_ids for r in again] == [r.token_ids for r in first]
    assert [r.stats.cached_tokens for r in again] == [59] * 3  # the target keeps its cached prefix
