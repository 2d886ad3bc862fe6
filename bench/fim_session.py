"""Editors typing against a server's /infill (llama-server's, or verispec serve's): the latency of the completions
an editor waits for, with the stale requests it cancels on the way.

    python bench/fim_session.py URL [--workload out/editor/fim_line.jsonl] [--editors 1] [--sessions 10]
        [--steps 6] [--chars 3] [--cancel-after 0.1] [--n-predict 32] [--pid PID] [--json-out FILE]

A session is one infill of the workload (bench/editor_workloads.py): the editor's cursor on the cut line, which
it types `--chars` characters at a time, as llama.vim and llama.vscode send it (input_prefix: the lines above;
prompt: the line up to the cursor; input_suffix: a newline and the lines below; greedy, `--n-predict` tokens, the
prompt cached). Each step sends a request; every second one is stale (the user typed on): it is cancelled (its
connection closed) after `--cancel-after` seconds and the next is sent at once; the others are waited for and
timed. `--editors` sessions run at once, each on its own problem. Reported: the median and p90 latency of the
completions waited for, their tokens/s, how many requests failed, first-line accuracy (the completion's first line
is the rest of the cut line, spaces aside), the cached prompt tokens where the server says (timings.cache_n), the
server's resident memory before and after (`--pid`), and one JSON line (with each completion's text, so that runs
against different servers can be compared). Start it on a fresh server: answers seen before make some drafters
faster."""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import httpx


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def steps(record: dict, count: int, chars: int) -> list[tuple[str, str, str, str]]:
    """(input_prefix, prompt, input_suffix, the rest of the line) of each step of typing the record's cut line."""
    line = record["expected"].split("\n")[0]
    out = []
    for i in range(count):
        typed = line[: i * chars]
        out.append((record["prefix"], typed, record["suffix"], line[len(typed):]))
    return out


def rss(pid: int | None) -> int | None:
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/status") as f:
            return next(int(row.split()[1]) * 1024 for row in f if row.startswith("VmRSS:"))
    except (OSError, StopIteration):
        return None


async def request(client: httpx.AsyncClient, url: str, prefix: str, typed: str, suffix: str, n_predict: int) -> dict:
    body = {"input_prefix": prefix, "prompt": typed, "input_suffix": suffix, "input_extra": [], "n_predict": n_predict,
            "temperature": 0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "stream": False, "cache_prompt": True}
    t0 = time.perf_counter()
    r = await client.post(url + "/infill", json=body)
    seconds = time.perf_counter() - t0
    if r.status_code != 200:
        raise RuntimeError(f"HTTP {r.status_code}: {r.text[:200]}")
    data = r.json()
    timings = data.get("timings") or {}
    return {"seconds": seconds, "content": data.get("content", ""), "tokens": data.get("tokens_predicted", 0),
            "cache_n": timings.get("cache_n"), "prompt_n": timings.get("prompt_n")}


async def session(client: httpx.AsyncClient, url: str, record: dict, args, out: list, errors: list) -> None:
    for i, (prefix, typed, suffix, rest) in enumerate(steps(record, args.steps, args.chars)):
        call = request(client, url, prefix, typed, suffix, args.n_predict)
        if i % 2:  # stale: the user typed on before it came back
            task = asyncio.ensure_future(call)
            done, _ = await asyncio.wait([task], timeout=args.cancel_after)
            if not done:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
                continue
            try:
                task.result()
            except Exception as exc:  # noqa: BLE001 - a failed request is counted, the session goes on
                errors.append(f"{record['question_id']} step {i}: {exc}")
            continue
        try:
            got = await call
        except Exception as exc:  # noqa: BLE001
            errors.append(f"{record['question_id']} step {i}: {exc}")
            continue
        first = got["content"].split("\n")[0]
        out.append({"problem": record["question_id"], "step": i, **got,
                    "first_line_right": first.strip() == rest.strip() and bool(rest.strip())})


async def run(args) -> dict:
    records = load(args.workload)[: args.sessions]
    out: list[dict] = []
    errors: list[str] = []
    limits = httpx.Limits(max_connections=2 * args.editors + 2)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0, connect=10.0), limits=limits) as client:
        await request(client, args.url, "def warm_up():\n    ", "", "\n", 4)  # not a timed problem
        before, t0 = rss(args.pid), time.perf_counter()
        queue = list(records)

        async def editor() -> None:
            while queue:
                await session(client, args.url, queue.pop(0), args, out, errors)

        await asyncio.gather(*(editor() for _ in range(args.editors)))
        wall = time.perf_counter() - t0
    after = rss(args.pid)
    latencies = sorted(r["seconds"] for r in out)
    tokens = sum(r["tokens"] for r in out)
    cached = [r["cache_n"] / (r["cache_n"] + r["prompt_n"]) for r in out
              if r["cache_n"] is not None and r["prompt_n"] is not None and r["cache_n"] + r["prompt_n"]]
    return {
        "url": args.url, "editors": args.editors, "sessions": len(records), "steps": args.steps, "chars": args.chars,
        "n_predict": args.n_predict, "cancel_after": args.cancel_after, "requests": len(records) * args.steps,
        "completed": len(out), "errors": len(errors), "error_lines": errors[:10],
        "latency_median": statistics.median(latencies) if latencies else None,
        "latency_p90": latencies[int(0.9 * (len(latencies) - 1))] if latencies else None,
        "tokens_per_second": tokens / sum(latencies) if latencies else None,
        "aggregate_tokens_per_second": tokens / wall if wall else None,
        "first_line_accuracy": sum(r["first_line_right"] for r in out) / len(out) if out else None,
        "cached_fraction_median": statistics.median(cached) if cached else None,
        "rss_before": before, "rss_after": after, "wall_seconds": wall,
        "completions": [{"problem": r["problem"], "step": r["step"], "content": r["content"],
                         "seconds": r["seconds"]} for r in out],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("url", help="the server's root, e.g. http://127.0.0.1:8080")
    ap.add_argument("--workload", default="out/editor/fim_line.jsonl")
    ap.add_argument("--editors", type=int, default=1, help="sessions at once")
    ap.add_argument("--sessions", type=int, default=10, help="problems typed")
    ap.add_argument("--steps", type=int, default=6, help="requests per session (every second one cancelled)")
    ap.add_argument("--chars", type=int, default=3, help="characters typed between two requests")
    ap.add_argument("--cancel-after", type=float, default=0.1, help="seconds before a stale request is cancelled")
    ap.add_argument("--n-predict", type=int, default=32)
    ap.add_argument("--pid", type=int, help="the server's process id, for its resident memory")
    ap.add_argument("--json-out", help="also write the report here")
    args = ap.parse_args()
    if not Path(args.workload).is_file():
        sys.exit(f"no workload at {args.workload}: run bench/editor_workloads.py first")
    args.url = args.url.rstrip("/")
    report = asyncio.run(run(args))
    fmt = lambda v, p: "-" if v is None else p.format(v)  # noqa: E731
    print(f"{args.url}: {report['completed']} completions waited for, {report['errors']} errors; latency median "
          f"{fmt(report['latency_median'], '{:.3f}')} s, p90 {fmt(report['latency_p90'], '{:.3f}')} s; "
          f"{fmt(report['tokens_per_second'], '{:.1f}')} tok/s per request; first line right "
          f"{fmt(report['first_line_accuracy'], '{:.0%}')}; prompt cached "
          f"{fmt(report['cached_fraction_median'], '{:.0%}')}"
          f"; RSS {fmt(report['rss_before'] and report['rss_before'] / 2**20, '{:.0f}')} -> "
          f"{fmt(report['rss_after'] and report['rss_after'] / 2**20, '{:.0f}')} MiB", file=sys.stderr)
    line = json.dumps(report)
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(line + "\n")
    print(line)


if __name__ == "__main__":
    main()
