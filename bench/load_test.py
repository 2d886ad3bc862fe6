#!/usr/bin/env python3
"""Load test for `verispec serve`: N requests at concurrency C on loopback, 20% malformed or hostile, 10% of
the valid ones dropped mid-way (streaming and not), then a burst that must provoke 429s, then 1,000 unknown
paths. Checks: no 5xx at all, every malformed request a 4xx, every kept valid request completes (a stream
only with its final chunk and [DONE], never after an error event), outputs equal to the same requests run
solo afterwards (greedy: identical; seeded sampling counted, the same up to the rounding of a batch), the
Prometheus series count unchanged by the unknown paths, server RSS growth under 5% between the 200th and the
last request. The server batches as its `--max-batch` default says unless `--max-batch` is given.
Bounded in count and time; 127.0.0.1 only.

    python bench/load_test.py --target DIR --draft DIR [--requests 1000 --concurrency 16]
Prints one JSON line; exits 1 if a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import time
from collections import Counter

import httpx
import psutil

MALFORMED = ["bad_json", "wrong_type", "negative_max_tokens", "huge_prompt", "unknown_model", "missing_field",
             "lone_surrogate", "huge_integer", "deep_nesting", "text_plain", "unsupported_field", "context_exceeded"]
N_UNKNOWN_PATHS = 1000
BURST_TOKENS = 128  # a burst request's length: the slots stay taken while the burst arrives


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "verispec.apps.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--target", args.target, "--dtype", args.dtype, "--served-model-name", args.model,
           "--max-queue", str(args.max_queue)]
    cmd += ["--draft", args.draft] if args.draft else ["--no-speculation"]
    cmd += ["--max-batch", str(args.max_batch)] if args.max_batch else []
    proc = subprocess.Popen(cmd, env=dict(os.environ, HF_HUB_OFFLINE="1"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 180
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit("server exited during start-up")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start")


def _malformed(kind: str, path: str, body: dict) -> tuple[str, bytes, str]:
    """(path, body bytes, content type) of one malformed or hostile request."""
    raw = None
    if kind == "bad_json":
        raw = json.dumps(body).encode()[:-7]
    elif kind == "wrong_type":
        body["max_tokens"] = "many"
    elif kind == "negative_max_tokens":
        body["max_tokens"] = -5
    elif kind == "huge_prompt":
        body.pop("messages", None)
        path, body["prompt"] = "/v1/completions", "word " * 400_000  # over the 1 MB body limit
    elif kind == "unknown_model":
        body["model"] = "no-such-model"
    elif kind == "missing_field":
        body.pop("model")
    elif kind == "lone_surrogate":
        raw = json.dumps(body).encode()[:-1] + b', "stop": "\\ud800"}'
    elif kind == "huge_integer":
        raw = json.dumps(body).encode()[:-1] + b', "seed": ' + b"7" * 5000 + b"}"
    elif kind == "deep_nesting":
        raw = json.dumps(body).encode()[:-1] + b', "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    elif kind == "text_plain":
        return path, json.dumps(body).encode(), "text/plain"
    elif kind == "unsupported_field":
        body["best_of"] = 3
    else:  # context_exceeded: the tiny models' context is 4,096 tokens (one per byte)
        body.pop("messages", None)
        path, body["prompt"], body["max_tokens"] = "/v1/completions", "z" * 4000, 200
    return path, raw if raw is not None else json.dumps(body).encode(), "application/json"


def _request(i: int, rng: random.Random, args) -> dict:
    """Request i: every 5th malformed (20%); every 10th, offset 1, dropped mid-way (10%), alternately
    streaming and not; the others greedy or seeded sampling, streaming or not."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": args.model, "max_tokens": args.max_tokens, "temperature": rng.choice([0, 0.8]), "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}: say something"}]
    else:
        body["prompt"] = f"request {i}:"
    if i % 5 == 0:
        kind = MALFORMED[(i // 5) % len(MALFORMED)]
        path, raw, ctype = _malformed(kind, path, body)
        return {"i": i, "kind": kind, "path": path, "body": raw, "ctype": ctype, "stream": False, "drop": False,
                "chat": path == "/v1/chat/completions"}
    drop = i % 10 == 1
    stream = (i // 10) % 2 == 0 if drop else rng.random() < 0.5
    if drop:
        body["max_tokens"] = args.drop_max_tokens  # long enough to be cut mid-way
    body["stream"] = stream
    return {"i": i, "kind": "valid", "path": path, "body": json.dumps(body).encode(), "ctype": "application/json",
            "stream": stream, "drop": drop, "chat": chat}


def _error_code(r: httpx.Response) -> str | None:
    try:
        return r.json()["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return "not-openai-format"


async def _stream(client, url, spec) -> dict:
    pieces, finished, error = [], False, False
    async with client.stream("POST", url + spec["path"], content=spec["body"],
                             headers={"content-type": spec["ctype"]}) as r:
        if r.status_code != 200:
            await r.aread()
            return {"status": r.status_code, "completed": False, "code": _error_code(r)}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if spec["drop"]:
                return {"status": 200, "completed": False, "dropped": True}  # leave after the first event
            if line == "data: [DONE]":
                break
            event = json.loads(line[6:])
            if "error" in event:
                error = True
                continue
            for choice in event.get("choices", []):
                pieces.append(choice["delta"].get("content") or "" if spec["chat"] else choice["text"])
                finished = finished or choice.get("finish_reason") is not None
    return {"status": 200, "completed": finished and not error, "text": "".join(pieces), "error_event": error}


async def _send(client, url, spec, drop_after_s: float) -> dict:
    started = time.perf_counter()
    try:
        if spec["stream"]:
            out = await _stream(client, url, spec)
        else:
            post = client.post(url + spec["path"], content=spec["body"], headers={"content-type": spec["ctype"]})
            try:
                r = await asyncio.wait_for(post, timeout=drop_after_s if spec["drop"] else None)
            except asyncio.TimeoutError:  # the connection is closed: the server must notice
                return {**spec, "status": 200, "completed": False, "dropped": True, "seconds": drop_after_s}
            out = {"status": r.status_code, "completed": r.status_code == 200 and "choices" in r.json()}
            if out["completed"]:
                choice = r.json()["choices"][0]
                out["text"] = choice["message"]["content"] if spec["chat"] else choice["text"]
            else:
                out["code"] = _error_code(r)
    except httpx.HTTPError as exc:
        out = {"status": 0, "completed": False, "error": repr(exc)}
    return {**spec, **out, "seconds": time.perf_counter() - started}


async def _solo(client, url, spec) -> str | None:
    """The text of the same request sent alone and not streamed."""
    body = json.loads(spec["body"]) | {"stream": False}
    r = await client.post(url + spec["path"], json=body)
    if r.status_code != 200:
        return None
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if spec["chat"] else choice["text"]


async def _burst(url, args) -> Counter:
    """More requests at once than the slots and the queue hold: some must get 429 with Retry-After. Each asks for
    BURST_TOKENS tokens (EOS ignored), so that no slot frees while the burst arrives, and each has a connection of
    its own."""
    models = httpx.get(url + "/v1/models").json()["data"]
    slots = next(m["verispec"]["max_batch"] for m in models if m.get("verispec"))
    n = slots + args.max_queue + 16
    body = {"model": args.model, "prompt": "burst", "max_tokens": BURST_TOKENS, "temperature": 0, "ignore_eos": True}
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=httpx.Limits(max_connections=n)) as client:
        replies = await asyncio.gather(*(client.post(url + "/v1/completions", json=body) for _ in range(n)))
    statuses = Counter(r.status_code for r in replies)
    statuses["429_with_retry_after"] = sum(r.status_code == 429 and "retry-after" in r.headers for r in replies)
    return statuses


def _series(text: str) -> int:
    return sum(1 for line in text.splitlines() if line and not line.startswith("#"))


def _metric(text: str, name: str) -> float:
    return next((float(line.split()[-1]) for line in text.splitlines() if line.startswith(name + " ")), 0.0)


async def run(args) -> dict:
    proc, url = _start_server(args)
    server = psutil.Process(proc.pid)
    rng = random.Random(args.seed)
    specs = [_request(i, rng, args) for i in range(args.requests)]
    results: list[dict] = []
    rss: dict[str, int] = {}
    sem = asyncio.Semaphore(args.concurrency)
    deadline = time.time() + args.timeout_s

    async def one(spec, client):
        async with sem:
            if time.time() > deadline:
                results.append({**spec, "status": -1, "completed": False})
                return
            results.append(await _send(client, url, spec, args.drop_after_s))
            if len(results) == min(200, args.requests):
                rss["at_200"] = server.memory_info().rss

    t0 = time.time()
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    try:
        async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
            await asyncio.gather(*(one(s, client) for s in specs))
            elapsed = time.time() - t0
            await asyncio.sleep(0.5)
            rss["at_end"] = server.memory_info().rss
            kept = [r for r in results if r["kind"] == "valid" and not r["drop"] and r.get("completed")]
            checked = random.Random(args.seed).sample(kept, min(args.solo_checks, len(kept)))
            solo = [(r, await _solo(client, url, r)) for r in checked]
            burst = await _burst(url, args)
            await client.get(url + "/no-such-path")  # the shared series for unknown paths exists from here
            await client.get(url + "/metrics")  # and that of /metrics' own answers
            series_before = _series((await client.get(url + "/metrics")).text)
            unknown = await asyncio.gather(*(client.get(f"{url}/probe-{i}/{rng.random()}")
                                             for i in range(N_UNKNOWN_PATHS)))
            metrics = (await client.get(url + "/metrics")).text
            series_after = _series(metrics)
            healthy = (await client.get(url + "/health")).status_code == 200
    finally:
        crashed = not server.is_running()
        proc.terminate()
        proc.wait(30)
    return _report(args, results, elapsed, rss, solo, burst, unknown, series_before, series_after, metrics,
                   crashed or not healthy)


def _report(args, results, elapsed, rss, solo, burst, unknown, series_before, series_after, metrics, crashed) -> dict:
    valid = [r for r in results if r["kind"] == "valid" and not r["drop"]]
    malformed = [r for r in results if r["kind"] != "valid"]
    greedy = [(r, s) for r, s in solo if json.loads(r["body"]).get("temperature") == 0]
    report = {
        "requests": len(results),
        "concurrency": args.concurrency,
        "seconds": round(elapsed, 2),
        "valid_sent": len(valid),
        "valid_completed": sum(r["completed"] for r in valid),
        "valid_error_events": sum(bool(r.get("error_event")) for r in valid),
        "dropped": sum(r["drop"] for r in results),
        "dropped_streaming": sum(r["drop"] and r["stream"] for r in results),
        "malformed_sent": len(malformed),
        "malformed_4xx": sum(400 <= r["status"] < 500 for r in malformed),
        "malformed_by_status_and_code": dict(Counter(f"{r['status']} {r.get('code')}" for r in malformed)),
        "malformed_by_kind": {kind: dict(Counter(r["status"] for r in malformed if r["kind"] == kind))
                              for kind in MALFORMED},
        "all_5xx": sum(r["status"] >= 500 or r["status"] == 0 for r in results)
                   + sum(n for s, n in burst.items() if isinstance(s, int) and s >= 500)
                   + sum(r.status_code >= 500 for r in unknown),
        "status_counts": dict(Counter(str(r["status"]) for r in results)),
        "solo_compared": len(solo),
        "solo_identical": sum(r["text"] == s for r, s in solo),
        "solo_greedy_compared": len(greedy),
        "solo_greedy_identical": sum(r["text"] == s for r, s in greedy),
        "burst": {str(k): v for k, v in burst.items()},
        "unknown_paths_404": sum(r.status_code == 404 for r in unknown),
        "series_before_unknown_paths": series_before,
        "series_after_unknown_paths": series_after,
        "cancelled_requests": _metric(metrics, "verispec_cancelled_requests_total"),
        "tokens_generated": _metric(metrics, "verispec_generated_tokens_total"),
        "tokens_generated_after_cancel": _metric(metrics, "verispec_generated_after_cancel_tokens_total"),
        "rss_mb_at_200": round(rss.get("at_200", 0) / 2**20, 1),
        "rss_mb_at_end": round(rss["at_end"] / 2**20, 1),
        "rss_growth_percent": round(100 * (rss["at_end"] - rss["at_200"]) / rss["at_200"], 2) if rss.get("at_200") else 0,
        "server_crashed": crashed,
        "slowest": sorted(((round(r.get("seconds", 0), 2), r["kind"], r["status"]) for r in results), reverse=True)[:5],
    }
    report["passed"] = (not crashed and report["all_5xx"] == 0 and report["valid_completed"] == report["valid_sent"]
                        and report["malformed_4xx"] == report["malformed_sent"]
                        and report["solo_greedy_identical"] == report["solo_greedy_compared"]
                        and report["burst"].get("429_with_retry_after", 0) > 0
                        and report["unknown_paths_404"] == N_UNKNOWN_PATHS
                        and series_after == series_before and report["rss_growth_percent"] < 5)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--draft")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--model", default="load-test")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-queue", type=int, default=20, help="the server's queue (above the concurrency: "
                                                             "429s come only from the burst)")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--max-batch", type=int, help="the server's --max-batch (default: its own)")
    p.add_argument("--drop-max-tokens", type=int, default=400, help="max_tokens of the requests dropped mid-way")
    p.add_argument("--drop-after-s", type=float, default=0.3, help="a dropped non-streaming request leaves after")
    p.add_argument("--solo-checks", type=int, default=100, help="completed requests re-run alone and compared")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=1200, help="stop sending after this long")
    p.add_argument("--request-timeout-s", type=float, default=300)
    p.add_argument("--json-out")
    args = p.parse_args()
    if args.max_queue < args.concurrency:
        p.error("--max-queue must be at least --concurrency (429s are provoked by the burst only)")
    report = asyncio.run(run(args))
    line = json.dumps(report)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
