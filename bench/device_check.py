"""What a CUDA machine with torch and transformers, but no network and no model files, tells of verispec.

1. Exactness on the device (tiny random Qwen2 models, fp32): greedy speculative decoding equals plain decoding, a
   lone engine and a batch of 4 sequences alike, and rows of one system prompt that copy its cache (computed once);
   the per-position marginals of sampled speculative decoding equal the target's, computed exactly (chi-square), and
   a verifier that accepts every draft fails the same test.
2. Host syncs per round (torch.cuda.set_sync_debug_mode): a lone and a batched engine's rounds, plain and drafting.
3. Costs on a Qwen2.5-1.5B-shaped random model in bf16 on the lean path: a pass over n = 1..16 tokens on a 512-token
   cache, and batches of B = 1..8 rows of 1 and of 5 tokens, each against one token.
4. Plain against speculative decoding with a self-draft (the same weights drafting for themselves, so greedy accepts
   every draft: the rounds per second the engine reaches when drafts are right), lone and 8 at a time, 128 tokens.

Prints each part and one JSON line. `--device cpu --small` runs the same on the CPU at toy sizes (a smoke test).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from stats_util import chi2_pvalue  # noqa: E402
from transformers import Qwen2Config, Qwen2ForCausalLM  # noqa: E402

from verispec.backends.lean import LeanBatch, LeanNet  # noqa: E402
from verispec.core.sampling import SamplingParams, probs_from_logits  # noqa: E402
from verispec.core.timing import sync  # noqa: E402
from verispec.decoding.engine import SpeculativeEngine  # noqa: E402
from verispec.decoding.request import Request  # noqa: E402
from verispec.proposers import DraftModel  # noqa: E402


def qwen(seed: int, device, dtype, vocab: int, hidden: int, layers: int, heads: int, kv: int, inter: int,
         init: float = 0.2):
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=4096,
                         tie_word_embeddings=False, initializer_range=init)
    torch.manual_seed(seed)
    with torch.device(device):
        return Qwen2ForCausalLM(config).to(dtype).eval()


def perturbed(model, seed: int, noise: float):
    copy = qwen(0, next(model.parameters()).device, next(model.parameters()).dtype, model.config.vocab_size,
                model.config.hidden_size, model.config.num_hidden_layers, model.config.num_attention_heads,
                model.config.num_key_value_heads, model.config.intermediate_size)
    copy.load_state_dict(model.state_dict())
    gen = torch.Generator(device=copy.device).manual_seed(seed)
    with torch.no_grad():
        for p in copy.parameters():
            p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * noise * p.std())
    return copy


def engine(target, draft, slots: int, k, eos=()):
    t = LeanBatch(LeanNet(target), slots)
    d = None if draft is None else DraftModel(LeanBatch(LeanNet(draft), slots), t.vocab_size)
    from verispec.decoding.policies.cost_aware import CostAwareK

    return SpeculativeEngine(t, d, eos, k, auto_policy=CostAwareK())


def run_batch(eng, requests: list[Request]) -> list:
    waiting, rows = list(requests), []
    while waiting or eng.active:
        while waiting and eng.free_slots:
            rows.append(eng.add(waiting.pop(0)))
        eng.step()
    return [row.result for row in rows]


# -- 1. exactness ------------------------------------------------------------------------------------------

def exactness(device) -> dict:
    target = qwen(1, device, torch.float32, 64, 64, 2, 4, 2, 128, init=0.6)
    draft = perturbed(target, 2, 0.3)
    prompts = [[3, 1, 4, 1, 5], [7], list(range(2, 40)), [9, 9, 9, 9]]
    plain = [engine(target, None, 1, 0).generate(p, max_new_tokens=40).token_ids for p in prompts]
    out = {"lone_greedy_identical": all(engine(target, draft, 1, k).generate(p, max_new_tokens=40).token_ids == ref
                                        for p, ref in zip(prompts, plain) for k in (1, 4))}
    results = run_batch(engine(target, draft, 4, 4), [Request(prompt_ids=p, max_new_tokens=40) for p in prompts])
    out["batch_greedy_identical"] = [r.token_ids for r in results] == plain
    out["batch_acceptance"] = sum(r.stats.accepted for r in results) / max(1, sum(r.stats.drafted for r in results))
    system = list(range(2, 38))  # rows of one 36-token system prompt: the first feeds it, the others copy its cache
    shared = [system + tail for tail in ([5], [6, 7], [8, 8, 8])]
    results = run_batch(engine(target, draft, 4, 4), [Request(prompt_ids=p, max_new_tokens=40) for p in shared])
    out["shared_prefill_cached"] = [r.stats.cached_tokens for r in results]
    out["shared_prefill_identical"] = [r.token_ids for r in results] == [
        engine(target, None, 1, 0).generate(p, max_new_tokens=40).token_ids for p in shared]
    out["marginals_p"] = marginals(target, draft, device)
    out["negative_control_p"] = marginals(target, draft, device, always_accept=True)
    out["ok"] = (out["lone_greedy_identical"] and out["batch_greedy_identical"] and out["shared_prefill_identical"]
                 and out["shared_prefill_cached"][1:] == [36, 36] and min(out["marginals_p"]) > 1e-4
                 and min(out["negative_control_p"]) < 1e-4)
    return out


def marginals(target, draft, device, always_accept: bool = False, n: int = 3000) -> list[float]:
    """Tokens 1-2 of n sampled generations (T = 1, top-k 8; batches of 8, each its own seed) against the target's
    exact marginals: a chi-square p-value per position."""
    prompt = [3, 1, 2]
    params = SamplingParams(temperature=1.0, top_k=8)
    with torch.no_grad():
        first = probs_from_logits(target(torch.tensor([prompt], device=device)).logits[0, -1:], params)[0].double()
        seqs = torch.tensor([prompt + [t] for t in range(64)], device=device)
        second = probs_from_logits(target(seqs).logits[:, -1], params).double()
        exact = [first.cpu(), (first[:, None] * second).sum(0).cpu()]
    import verispec.core.rows as rows

    original = rows.rejection_sample
    if always_accept:
        def accept_all(draft_tokens, draft_probs, target_probs, rng):
            k = draft_tokens.shape[1]
            bonus = torch.multinomial(target_probs[:, k], 1, generator=rng).squeeze(-1)
            return torch.full((draft_tokens.shape[0],), k, device=draft_tokens.device), bonus
        rows.rejection_sample = accept_all
    try:
        eng = engine(target, draft, 8, 2)
        requests = [Request(prompt_ids=prompt, params=SamplingParams(temperature=1.0, top_k=8, seed=i),
                            max_new_tokens=3) for i in range(n)]  # token 1 is the prefill's, token 2 a draft's
        results = run_batch(eng, requests)
    finally:
        rows.rejection_sample = original
    counts = torch.zeros(2, 64, dtype=torch.long)
    for r in results:
        for pos, tok in enumerate(r.token_ids[:2]):
            counts[pos, tok] += 1
    return [chi2_pvalue(counts[pos], exact[pos], min_samples=n) for pos in range(2)]


# -- 2. host syncs per round -------------------------------------------------------------------------------

def syncs(device) -> dict:
    if device.type != "cuda":
        return {"skipped": "host syncs are counted on CUDA only"}
    target = qwen(1, device, torch.float32, 64, 64, 2, 4, 2, 128, init=0.6)
    draft = perturbed(target, 2, 0.05)
    out = {}
    for name, slots, k in (("lone plain", 1, 0), ("lone k=4", 1, 4), ("batch 4 k=4", 4, 4),
                           ("lone sampled k=4", 1, 4)):
        eng = engine(target, draft if k else None, slots, k)
        params = SamplingParams(temperature=1.0, seed=1) if "sampled" in name else SamplingParams()
        for s in range(slots):
            eng.add(Request(prompt_ids=[3, 1, 4, 1, 5 + s], params=params, max_new_tokens=64))
        eng.step()  # the prefill round and one-off measurements
        counts = []
        for _ in range(10):
            if not eng.active:
                break
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    eng.step()
                finally:
                    torch.cuda.set_sync_debug_mode(0)
            counts.append(sum("synchroniz" in str(w.message) for w in caught))
        out[name] = {"syncs_per_round": counts, "max": max(counts) if counts else None}
    out["ok"] = all(v["max"] is not None and v["max"] <= 1 for v in out.values() if isinstance(v, dict))
    return out


# -- 3. pass costs -----------------------------------------------------------------------------------------

def timed(fn, device, repeats: int = 7) -> float:
    times = []
    for _ in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times[1:])[len(times[1:]) // 2]


def costs(model, device, context: int = 512) -> dict:
    batch = LeanBatch(LeanNet(model), 8)
    gen, vocab = torch.Generator().manual_seed(0), model.config.vocab_size
    for slot in range(8):
        batch.forward_rows([slot], [torch.randint(0, vocab, (context,), generator=gen).to(device)], logits_for=[0])
    tokens = torch.randint(0, vocab, (16,), generator=gen).to(device)

    def one_pass(rows: int, n: int):
        def fn():
            batch.forward_rows(list(range(rows)), [tokens[:n]] * rows)
            for slot in range(rows):
                batch.rollback(slot, context)
        return fn

    one = timed(one_pass(1, 1), device)
    widths = {n: timed(one_pass(1, n), device) / one for n in range(1, 17)}
    batches = {f"{b}x{n}": timed(one_pass(b, n), device) / one for b in range(1, 9) for n in (1, 5)}
    return {"one_token_ms": one * 1e3, "c(n)": widths, "batch BxN": batches}


# -- 4. plain against speculative --------------------------------------------------------------------------

def speed(model, device, new: int = 128) -> dict:
    prompts = [[(100 + 7 * i + j) % model.config.vocab_size for j in range(64)] for i in range(8)]
    out = {}
    for slots in (1, 8):
        rates = {}
        for name, k in (("plain", 0), ("self-draft k=4", 4), ("self-draft k=auto", "auto")):
            eng = engine(model, None if k == 0 else model, slots, k)
            run_batch(eng, [Request(prompt_ids=prompts[0], max_new_tokens=8)])  # warm up
            t0 = time.perf_counter()
            results = run_batch(eng, [Request(prompt_ids=p, max_new_tokens=new) for p in prompts[:slots]])
            sync(device)
            seconds = time.perf_counter() - t0
            tokens = sum(len(r.token_ids) for r in results)
            rates[name] = {"tokens_per_second": tokens / seconds,
                           "rounds_per_second": sum(r.stats.target_forwards for r in results) / seconds / slots,
                           "acceptance": sum(r.stats.accepted for r in results) / max(1, sum(r.stats.drafted
                                                                                              for r in results))}
        for name in rates:
            rates[name]["vs_plain"] = rates[name]["tokens_per_second"] / rates["plain"]["tokens_per_second"]
        out[f"{slots} at a time"] = rates
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="toy sizes for parts 3 and 4 (a smoke test)")
    args = ap.parse_args()
    device = torch.device(args.device)
    report = {"torch": torch.__version__, "device": torch.cuda.get_device_name(device) if device.type == "cuda"
              else "cpu"}
    t0 = time.perf_counter()
    report["exactness"] = exactness(device)
    print("exactness:", json.dumps(report["exactness"]), flush=True)
    report["syncs"] = syncs(device)
    print("host syncs per round:", json.dumps(report["syncs"]), flush=True)
    shape = (dict(vocab=4096, hidden=128, layers=2, heads=4, kv=2, inter=256) if args.small else
             dict(vocab=151936, hidden=1536, layers=28, heads=12, kv=2, inter=8960))  # Qwen2.5-1.5B
    model = qwen(3, device, torch.bfloat16, **shape, init=0.02)
    report["costs"] = costs(model, device, 64 if args.small else 512)
    c = report["costs"]
    print(f"pass over n tokens / one token ({c['one_token_ms']:.2f} ms): "
          + ", ".join(f"{n}: {v:.2f}" for n, v in c["c(n)"].items()), flush=True)
    print("batches BxN / one token: " + ", ".join(f"{k}: {v:.2f}" for k, v in c["batch BxN"].items()), flush=True)
    report["speed"] = speed(model, device, 16 if args.small else 128)
    for slots, rates in report["speed"].items():
        print(f"{slots}: " + "; ".join(f"{name} {r['tokens_per_second']:.1f} tok/s ({r['vs_plain']:.2f}x, "
                                        f"acceptance {r['acceptance']:.2f})" for name, r in rates.items()),
              flush=True)
    report["seconds"] = time.perf_counter() - t0
    report["ok"] = report["exactness"]["ok"] and report["syncs"].get("ok", True)
    print(json.dumps(report, default=lambda v: round(v, 4) if isinstance(v, float) and math.isfinite(v) else str(v)))
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
