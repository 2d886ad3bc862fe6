#!/usr/bin/env python3
"""Load test for `verispec serve`: N requests at concurrency C on loopback, a share of them malformed, some
streams dropped mid-way. Checks: no crash, no 5xx for valid requests, every valid request completes, server
RSS growth under 5% between the 200th and the last request. Bounded in count and time; 127.0.0.1 only.

    python bench/load_test.py --target DIR --draft DIR [--requests 1000 --concurrency 16]
    python bench/load_test.py --url http://127.0.0.1:8000 --model NAME --pid PID
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

import httpx
import psutil

MALFORMED = ["bad_json", "wrong_type", "negative_max_tokens", "huge_prompt", "unknown_model", "missing_field"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server(args) -> tuple[subprocess.Popen, str]:
    port = _free_port()
    cmd = [sys.executable, "-m", "verispec.cli", "serve", "--port", str(port), "--log-level", "warning",
           "--target", args.target, "--dtype", args.dtype, "--served-model-name", args.model,
           "--max-queue", str(4 * args.concurrency), "--max-prompt-tokens", "2000"]
    cmd += ["--draft", args.draft] if args.draft else ["--no-speculation"]
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


def _request(i: int, rng: random.Random, model: str, max_tokens: int, disconnect_share: float):
    """(kind, path, body bytes, stream, disconnect) for request i; every 5th is malformed (20%)."""
    chat = rng.random() < 0.5
    path = "/v1/chat/completions" if chat else "/v1/completions"
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": rng.choice([0, 0.8]), "seed": i}
    if chat:
        body["messages"] = [{"role": "user", "content": f"request {i}: say something"}]
    else:
        body["prompt"] = f"request {i}:"
    if i % 5 == 0:
        kind = MALFORMED[(i // 5) % len(MALFORMED)]
        if kind == "bad_json":
            return kind, path, b'{"model": "' + model.encode() + b'", "prompt": ', False, False
        if kind == "wrong_type":
            body["max_tokens"] = "many"
        elif kind == "negative_max_tokens":
            body["max_tokens"] = -5
        elif kind == "huge_prompt":
            body.pop("messages", None)
            path, body["prompt"] = "/v1/completions", "word " * rng.choice([3000, 400_000])
        elif kind == "unknown_model":
            body["model"] = "no-such-model"
        else:
            body.pop("model")
        return kind, path, json.dumps(body).encode(), False, False
    stream = rng.random() < 0.5
    disconnect = stream and rng.random() < disconnect_share * 2
    body["stream"] = stream
    return "valid", path, json.dumps(body).encode(), stream, disconnect


async def _send(client: httpx.AsyncClient, url: str, spec) -> dict:
    kind, path, body, stream, disconnect = spec
    headers = {"content-type": "application/json"}
    started = time.perf_counter()
    try:
        return {**await _send_once(client, url, kind, path, body, stream, disconnect, headers),
                "seconds": time.perf_counter() - started}
    except httpx.HTTPError as exc:
        return {"kind": kind, "status": 0, "completed": False, "disconnect": disconnect, "error": repr(exc),
                "seconds": time.perf_counter() - started}


async def _send_once(client, url, kind, path, body, stream, disconnect, headers) -> dict:
    if not stream:
        r = await client.post(url + path, content=body, headers=headers)
        ok = r.status_code == 200 and "choices" in r.json()
        return {"kind": kind, "status": r.status_code, "completed": ok, "disconnect": False}
    async with client.stream("POST", url + path, content=body, headers=headers) as r:
        done = False
        async for line in r.aiter_lines():
            if disconnect and line.startswith("data:"):
                break  # drop the connection mid-stream
            if line == "data: [DONE]":
                done = True
        return {"kind": kind, "status": r.status_code, "completed": done, "disconnect": disconnect}


async def run(args) -> dict:
    proc = None
    url, pid = args.url, args.pid
    if url is None:
        proc, url = _start_server(args)
        pid = proc.pid
    server = psutil.Process(pid)
    rng = random.Random(args.seed)
    specs = [_request(i, rng, args.model, args.max_tokens, args.disconnect) for i in range(args.requests)]
    results: list[dict] = []
    rss: dict[str, int] = {}
    sem = asyncio.Semaphore(args.concurrency)
    deadline = time.time() + args.timeout_s

    async def one(spec, client):
        async with sem:
            if time.time() > deadline:
                results.append({"kind": spec[0], "status": -1, "completed": False, "disconnect": False})
                return
            results.append(await _send(client, url, spec))
            if len(results) == min(200, args.requests):
                rss["at_200"] = server.memory_info().rss

    t0 = time.time()
    limits = httpx.Limits(max_connections=args.concurrency * 2)
    async with httpx.AsyncClient(timeout=args.request_timeout_s, limits=limits) as client:
        await asyncio.gather(*(one(s, client) for s in specs))
    elapsed = time.time() - t0
    await asyncio.sleep(0.5)
    rss["at_end"] = server.memory_info().rss
    crashed = not server.is_running()
    try:
        healthy = httpx.get(url + "/health", timeout=5).status_code == 200
    except httpx.HTTPError:
        healthy = False
    metrics = httpx.get(url + "/metrics", timeout=5).text if healthy else ""
    if proc is not None:
        proc.terminate()
        proc.wait(30)

    valid = [r for r in results if r["kind"] == "valid" and not r["disconnect"]]
    malformed = [r for r in results if r["kind"] != "valid"]
    report = {
        "requests": len(results),
        "concurrency": args.concurrency,
        "seconds": round(elapsed, 2),
        "requests_per_second": round(len(results) / elapsed, 2),
        "valid_sent": len(valid),
        "valid_completed": sum(r["completed"] for r in valid),
        "valid_5xx": sum(r["status"] >= 500 or r["status"] <= 0 for r in valid),
        "disconnects": sum(r["disconnect"] for r in results),
        "malformed_sent": len(malformed),
        "malformed_4xx": sum(400 <= r["status"] < 500 for r in malformed),
        "malformed_5xx": sum(r["status"] >= 500 for r in malformed),
        "status_counts": {str(s): sum(r["status"] == s for r in results) for s in sorted({r["status"] for r in results})},
        "slowest": sorted(((round(r["seconds"], 2), r["kind"], r["status"]) for r in results), reverse=True)[:8],
        "rss_mb_at_200": round(rss.get("at_200", 0) / 2**20, 1),
        "rss_mb_at_end": round(rss["at_end"] / 2**20, 1),
        "rss_growth_percent": round(100 * (rss["at_end"] - rss["at_200"]) / rss["at_200"], 2) if rss.get("at_200") else 0,
        "server_crashed": crashed or not healthy,
        "metrics": [line for line in metrics.splitlines() if line.startswith("verispec_") and "_bucket" not in line],
    }
    report["passed"] = (not report["server_crashed"] and report["valid_5xx"] == 0 and report["malformed_5xx"] == 0
                        and report["valid_completed"] == report["valid_sent"]
                        and report["malformed_4xx"] == report["malformed_sent"] and report["rss_growth_percent"] < 5)
    return report


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="an already running server (loopback); else one is started")
    p.add_argument("--pid", type=int, help="that server's process id (for RSS)")
    p.add_argument("--target")
    p.add_argument("--draft")
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--model", default="load-test")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--disconnect", type=float, default=0.05, help="share of requests that drop mid-stream")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout-s", type=float, default=1200, help="stop sending after this long")
    p.add_argument("--request-timeout-s", type=float, default=300)
    p.add_argument("--json-out")
    args = p.parse_args()
    if args.url is None and args.target is None:
        p.error("give --target (and --draft) to start a server, or --url and --pid")
    if args.url is not None and not args.url.startswith(("http://127.", "http://localhost", "http://[::1]")):
        p.error("the load test only sends traffic to loopback addresses")
    report = asyncio.run(run(args))
    line = json.dumps(report)
    if args.json_out:
        with open(args.json_out, "w") as f:
            f.write(line + "\n")
    print(line)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
