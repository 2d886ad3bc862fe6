"""Prompt prefill on llama.cpp: verispec's against llama.cpp's own, the same GGUF, in one process.

    python bench/prefill.py [--lengths 256,1024,3072] [--repeats 3]

For each prompt length (HumanEval code, repeated to length), median over repeats, fresh caches each time:
- llama-cpp-python: `Llama.eval` of the prompt (its own batching, n_batch 512, every core, flash attention: the
  build `make install-llamacpp` made, verispec's kernels in it);
- verispec forward: the target's `forward_rows` over the whole prompt, keeping the last position's logits (the
  backend alone);
- verispec engine: a request's first token from the default target with plain decoding (`generate(..., k=0,
  max_new_tokens=1)`): the engine feeds the prompt in parts of PREFILL_CHUNK tokens per round, as a server does.
Prints prefill tokens/s and the ratios to llama-cpp-python's, then one JSON line."""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import time
from pathlib import Path

import torch

import verispec
from verispec.backends.llamacpp import open_llama
from verispec.backends.loading import resolve_gguf
from verispec.catalog import DEFAULT_TARGET

DATA = Path(os.environ.get("BENCH_DATA", Path(__file__).resolve().parents[2] / "shared" / "bench-data"))


def prompt_ids(tokenizer, length: int) -> list[int]:
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        code = "".join(r["prompt"] + r["canonical_solution"] for r in map(json.loads, f))
    ids = tokenizer(code, add_special_tokens=False).input_ids
    return (ids * (length // len(ids) + 1))[:length]


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="256,1024,3072")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    pipe = verispec.load(DEFAULT_TARGET, drafter=None, backend="llamacpp")
    target = pipe.engine.target
    llm = open_llama(resolve_gguf(DEFAULT_TARGET), n_ctx=max(lengths) + 64)
    rows = []
    for n in lengths:
        ids = prompt_ids(pipe.tokenizer, n)

        def llama_eval():
            llm.reset()
            llm.eval(ids)

        def forward():
            target.reset()
            target.forward_rows([0], [torch.tensor(ids)], last_only=True)

        def engine():
            pipe.engine.reset()
            pipe.generate(ids, max_new_tokens=1, k=0)

        seconds = {name: timed(fn, args.repeats) for name, fn in
                   (("llama-cpp-python", llama_eval), ("verispec forward", forward), ("verispec engine", engine))}
        row = {"tokens": n, **{f"{k} tok/s": n / v for k, v in seconds.items()}}
        row["forward / llama-cpp-python"] = seconds["llama-cpp-python"] / seconds["verispec forward"]
        row["engine / llama-cpp-python"] = seconds["llama-cpp-python"] / seconds["verispec engine"]
        rows.append(row)
        print("  ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()), flush=True)
    print(json.dumps({"target": DEFAULT_TARGET, "kernels": pipe.kernels, "rows": rows}))


if __name__ == "__main__":
    main()
