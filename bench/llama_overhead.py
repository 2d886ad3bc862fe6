"""What each decoder costs on llama.cpp beside llama.cpp's own evals, measured inside one process.

End-to-end tokens/s ratios on this VM swing +-5% in aggregate even between two decoders that make identical
evals (the machine's speed drifts), which hides the difference "never below 0.98x of plain llama.cpp" is
about. This script splits every generation's wall time into the time inside llama_decode (the target's
context and the draft's, timed by a wrapper around the C call) and the rest (Python, sampling, copying
logits: the decoder's own overhead), and records every target eval's size. Noise in the evals then no
longer hides the decoders' differences: where verispec makes the same target evals as llama-cpp-python's
plain decoding (k = auto with a drafter that does not pay), the rest is the whole difference.

Usage: python bench/llama_overhead.py [--prompts FILE] [--limit 6] [--max-new-tokens 96]
Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict

import llama_cpp

from verispec.apps.bench import harness
from verispec.apps.bench.harness import Bench, Config
from verispec.apps.bench.loader import load_prompts, select
from verispec.apps.bench.measured import balanced_orders
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.core.sampling import SamplingParams
from verispec.pipeline.text import encode_prompt

DECODERS = [
    Config("llama-cpp-python plain", "llama"),
    Config("verispec plain", "plain"),
    Config("verispec model k=auto", "spec", "auto", "model"),
    Config("verispec ngram k=auto", "spec", "auto", "ngram"),
    Config("verispec hybrid k=auto", "spec", "auto", "hybrid"),
]


def _address(ctx) -> int:
    """A llama_context pointer as an int (ctypes hands it over as an int or as a c_void_p)."""
    return ctx if isinstance(ctx, int) else ctx.value


class DecodeTimer:
    """Wraps llama_cpp.llama_decode (both names it is called by): seconds and batch sizes per context."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = defaultdict(float)
        self.sizes: dict[int, list[int]] = defaultdict(list)
        self._original = llama_cpp.llama_cpp.llama_decode

    def __enter__(self) -> DecodeTimer:
        def timed(ctx, batch):
            t0 = time.perf_counter()
            status = self._original(ctx, batch)
            key = _address(ctx)
            self.seconds[key] += time.perf_counter() - t0
            self.sizes[key].append(int(batch.n_tokens))
            return status

        llama_cpp.llama_decode = llama_cpp.llama_cpp.llama_decode = timed
        return self

    def __exit__(self, *exc) -> None:
        llama_cpp.llama_decode = llama_cpp.llama_cpp.llama_decode = self._original

    def clear(self) -> None:
        self.seconds.clear()
        self.sizes.clear()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", default="../shared/bench-data/HumanEval.jsonl.gz")
    ap.add_argument("--limit", type=int, default=6)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    args = ap.parse_args()
    bench = Bench(TargetSpec("qwen2.5-coder-1.5b-instruct", "llamacpp", "cpu"),
                  DraftSpec("model", "qwen2.5-coder-0.5b-instruct", "llamacpp"))
    pipe = bench.baseline
    target_ctx = _address(pipe.engine.target._ctx)
    prompts = select(load_prompts(args.prompts), limit=args.limit)
    params = SamplingParams()
    orders = balanced_orders(len(DECODERS))
    totals = {c.name: defaultdict(float) for c in DECODERS}
    evals: dict[str, dict[str, list[int]]] = {c.name: {} for c in DECODERS}
    with DecodeTimer() as timer:
        ids0 = encode_prompt(pipe.tokenizer, prompts[0].text, prompts[0].chat)
        for config in DECODERS:  # warm-up
            harness._one(bench, config, ids0, params, 8)
        for i, prompt in enumerate(prompts):
            ids = encode_prompt(pipe.tokenizer, prompt.text, prompt.chat)
            for j in orders[i % len(orders)]:
                config = DECODERS[j]
                timer.clear()
                out = harness._one(bench, config, ids, params, args.max_new_tokens)
                t = totals[config.name]
                t["seconds"] += out["seconds"]
                t["new_tokens"] += out["new_tokens"]
                t["target_eval_seconds"] += timer.seconds.get(target_ctx, 0.0)
                t["draft_eval_seconds"] += sum(s for key, s in timer.seconds.items() if key != target_ctx)
                t["target_evals"] += len(timer.sizes.get(target_ctx, []))
                t["drafted"] += out.get("drafted", 0)
                evals[config.name][prompt.id] = timer.sizes.get(target_ctx, [])
    base = "llama-cpp-python plain"
    rows = []
    print(f"{'decoder':26s} {'tokens':>6s} {'target evals':>12s} {'same evals':>10s} {'drafted':>7s} "
          f"{'eval ms/tok':>11s} {'other ms/tok':>12s} {'other share':>11s}")
    for config in DECODERS:
        t = totals[config.name]
        other = t["seconds"] - t["target_eval_seconds"] - t["draft_eval_seconds"]
        same = sum(evals[config.name][p.id] == evals[base][p.id] for p in prompts)
        row = dict(decoder=config.name, new_tokens=int(t["new_tokens"]), target_evals=int(t["target_evals"]),
                   same_target_evals_as_llama_cpp_python=f"{same}/{len(prompts)}", drafted=int(t["drafted"]),
                   eval_ms_per_token=1000 * (t["target_eval_seconds"] + t["draft_eval_seconds"]) / t["new_tokens"],
                   other_ms_per_token=1000 * other / t["new_tokens"], other_share=other / t["seconds"])
        rows.append(row)
        print(f"{config.name:26s} {row['new_tokens']:6d} {row['target_evals']:12d} {row['same_target_evals_as_llama_cpp_python']:>10s} "
              f"{row['drafted']:7d} {row['eval_ms_per_token']:11.2f} {row['other_ms_per_token']:12.3f} "
              f"{row['other_share']:11.2%}")
    print(json.dumps(dict(prompts=len(prompts), max_new_tokens=args.max_new_tokens, decoders=rows)))


if __name__ == "__main__":
    main()
