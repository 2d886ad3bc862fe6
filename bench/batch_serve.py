#!/usr/bin/env python3
"""Batched serving against one-at-a-time serving, in one run: `verispec serve --max-batch N` and
`verispec serve --max-batch 1` (the baseline) on the same pair, each sent the same prompts (HumanEval and
Spec-Bench) at concurrency 1, 2, 4, 8. Per server and concurrency: aggregate tokens/s (all completion tokens
over the wall time), per-request latency (median, p90) and time to first token; the ratios against the
baseline: aggregate over the baseline's aggregate at the same concurrency, median latency over the
baseline's median at concurrency 1 (a request served alone). Greedy outputs are compared across every run.

First, in this process, the target's cost of one forward over B sequences x n new tokens on a ~300-token
cache (what the batch shares), median of a few.

    python bench/batch_serve.py [--dtype fp32] [--max-tokens 64] [--concurrency 1,2,4,8] [--json-out FILE]

The servers run one after the other (never beside each other or anything else). Prints tables, then one
JSON line.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

DATA = Path(os.environ.get("BENCH_DATA", Path(__file__).resolve().parents[2] / "shared" / "bench-data"))


def _prompts(humaneval: int, spec_bench: int) -> list[dict]:
    from verispec.apps.bench.loader import load_prompts, select

    picked = select(load_prompts(DATA / "HumanEval.jsonl.gz"), limit=humaneval)
    per_category = max(1, -(-spec_bench // 6))
    picked += select(load_prompts(DATA / "spec_bench_question.jsonl"), per_category=per_category)[:spec_bench]
    return [{"id": p.id, "category": p.category, "text": p.text, "chat": p.chat} for p in picked]


def verify_costs(args) -> list[dict]:
    """Seconds of one target forward over B sequences x n new tokens (the batch's shared pass)."""
    import torch

    import verispec

    pipe = verispec.load(backend="hf", drafter=None, dtype=args.dtype)
    batch = pipe.batch(max(args.batch_sizes))
    target = batch.target
    gen = torch.Generator().manual_seed(0)
    for slot in range(target.slots):
        target.forward_rows([slot], [torch.randint(0, 30000, (300,), generator=gen)])
    rows = []
    for b in args.batch_sizes:
        for n in (1, args.k + 1):
            times = []
            for _ in range(5):
                feeds = [torch.randint(0, 30000, (n,), generator=gen) for _ in range(b)]
                t0 = time.perf_counter()
                target.forward_rows(list(range(b)), feeds)
                times.append(time.perf_counter() - t0)
                for slot in range(b):
                    target.rollback(slot, 300)
            rows.append({"sequences": b, "new_tokens": n, "rows": b * n, "seconds": statistics.median(times[1:])})
    single = next(r["seconds"] for r in rows if r["rows"] == 1)
    for r in rows:
        r["vs_one_row"] = r["seconds"] / single
    del pipe, batch, target
    gc.collect()
    return rows


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, args, max_batch: int) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "verispec.apps.cli", "serve", "--port", str(self.port), "--log-level", "warning",
               "--backend", "hf", "--dtype", args.dtype, "-k", str(args.k), "--max-batch", str(max_batch),
               "--served-model-name", "bench"]
        self.proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 300
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"the server (max-batch {max_batch}) exited during start-up")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit("the server did not start")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def _request(url: str, prompt: dict, max_tokens: int) -> dict:
    """One streamed greedy request: latency, time to first token, completion tokens, text."""
    body = {"model": "bench", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if prompt["chat"]:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": prompt["text"]}]
    else:
        path, body["prompt"] = "/v1/completions", prompt["text"]
    t0 = time.perf_counter()
    first, text, tokens = None, [], 0
    with httpx.stream("POST", url + path, json=body, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            for choice in chunk.get("choices", []):
                piece = (choice.get("delta") or {}).get("content") or choice.get("text") or ""
                if piece and first is None:
                    first = time.perf_counter() - t0
                text.append(piece)
    return {"id": prompt["id"], "seconds": time.perf_counter() - t0, "ttft": first, "tokens": tokens,
            "text": "".join(text)}


def run_level(url: str, prompts: list[dict], concurrency: int, max_tokens: int) -> dict:
    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(lambda p: _request(url, p, max_tokens), prompts))
    wall = time.perf_counter() - t0
    latencies = sorted(a["seconds"] for a in answers)
    tokens = sum(a["tokens"] for a in answers)
    return {"concurrency": concurrency, "wall_seconds": wall, "tokens": tokens, "tok_per_s": tokens / wall,
            "latency_median": statistics.median(latencies), "latency_p90": latencies[int(0.9 * (len(latencies) - 1))],
            "ttft_median": statistics.median(a["ttft"] for a in answers if a["ttft"] is not None),
            "texts": {a["id"]: a["text"] for a in answers}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    ap.add_argument("-k", type=int, default=4, help="draft tokens per round on both servers")
    ap.add_argument("--max-batch", type=int, default=8, help="the batched server's --max-batch")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--humaneval", type=int, default=16)
    ap.add_argument("--spec-bench", type=int, default=16)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--baseline-concurrency", default="1,4",
                    help="concurrencies for the one-at-a-time server (its aggregate does not depend on it)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    base_levels = [int(c) for c in args.baseline_concurrency.split(",")]
    args.batch_sizes = sorted({1, 2, 4, 8, args.max_batch})
    prompts = _prompts(args.humaneval, args.spec_bench)
    print(f"{len(prompts)} prompts, {args.max_tokens} new tokens, greedy, dtype {args.dtype}, k {args.k}", flush=True)

    costs = verify_costs(args)
    print("\ntarget forward, B sequences x n new tokens (300-token caches)")
    print(f"{'B':>3} {'n':>3} {'rows':>5} {'ms':>8} {'x one row':>10}")
    for c in costs:
        print(f"{c['sequences']:>3} {c['new_tokens']:>3} {c['rows']:>5} {1000 * c['seconds']:>8.1f} {c['vs_one_row']:>10.2f}")

    results = {}
    for name, max_batch, run_levels in (("one-at-a-time", 1, base_levels), (f"batched-{args.max_batch}",
                                                                             args.max_batch, levels)):
        server = Server(args, max_batch)
        try:
            _request(server.url, prompts[0], 8)  # warm-up
            results[name] = []
            for c in run_levels:
                level = run_level(server.url, prompts, c, args.max_tokens)
                results[name].append(level)
                print(f"{name} c={c}: {level['tok_per_s']:.2f} tok/s, median latency {level['latency_median']:.1f} s",
                      flush=True)
        finally:
            server.stop()

    base = {lv["concurrency"]: lv for lv in results["one-at-a-time"]}
    solo = base[min(base)]["latency_median"]
    reference = base[min(base)]["texts"]
    print(f"\n{'server':<16} {'conc.':>5} {'tok/s':>7} {'x 1-at-a-time':>13} {'lat. med':>9} {'x solo':>7} "
          f"{'p90':>6} {'TTFT med':>9} {'same text':>9}")
    summary = []
    for name, levels_done in results.items():
        for lv in levels_done:
            ref = base.get(lv["concurrency"], base[max(b for b in base if b <= lv["concurrency"])])
            same = sum(lv["texts"][k] == v for k, v in reference.items())
            row = {"server": name, "concurrency": lv["concurrency"], "tok_per_s": lv["tok_per_s"],
                   "vs_one_at_a_time": lv["tok_per_s"] / ref["tok_per_s"], "latency_median": lv["latency_median"],
                   "latency_vs_solo": lv["latency_median"] / solo, "latency_p90": lv["latency_p90"],
                   "ttft_median": lv["ttft_median"], "same_text": same, "prompts": len(reference)}
            summary.append(row)
            print(f"{name:<16} {lv['concurrency']:>5} {lv['tok_per_s']:>7.2f} {row['vs_one_at_a_time']:>12.2f}x "
                  f"{lv['latency_median']:>8.1f}s {row['latency_vs_solo']:>6.2f}x {lv['latency_p90']:>5.1f}s "
                  f"{lv['ttft_median']:>8.2f}s {same:>5}/{len(reference)}")
    out = {"prompts": len(prompts), "max_tokens": args.max_tokens, "dtype": args.dtype, "k": args.k,
           "max_batch": args.max_batch, "verify_costs": costs, "runs": summary}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(out, indent=1))
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
