"""The text path alone: generated ids -> streamed text pieces with their provenance and stop checks, as a stream or a
server runs it round by round (the stop test on the generated ids, then the round's tokens pushed), at 1k to 32k
tokens, against the path that decodes all the generated ids every round (tests/text_reference.py) in the same run.

    python bench/text_path.py [--tokenizer qwen2.5-coder-1.5b-instruct] [--lengths 1024,...,32768]

The ids are real text (HumanEval and Spec-Bench, one after another until the length is reached) tokenised by the
model's tokenizer; rounds commit 1-5 tokens (seeded); two stop strings that never occur are checked. Prints, per
length, milliseconds per token (median of --repeats) for both paths, their ratio, each length's cost against the
shortest's, and one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))

from text_reference import ReferenceText  # noqa: E402

from verispec.pipeline.provenance import ProvenanceText  # noqa: E402

DATA = Path(os.environ.get("BENCH_DATA", Path(__file__).resolve().parent.parent.parent / "shared" / "bench-data"))
STOPS = ["</never-a-stop>", "\n\n\n\n\n\n"]


def corpus(tokenizer, n: int) -> list[int]:
    """n ids of real text: HumanEval prompts and solutions, then Spec-Bench questions, round and round."""
    texts = []
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        texts += [r["prompt"] + r["canonical_solution"] for r in map(json.loads, f)]
    with open(DATA / "spec_bench_question.jsonl") as f:
        texts += ["\n".join(r["turns"]) for r in map(json.loads, f)]
    ids: list[int] = []
    while len(ids) < n:
        for text in texts:
            ids += tokenizer(text, add_special_tokens=False).input_ids
            if len(ids) >= n:
                break
    return ids[:n]


def stream(make, ids: list[int], seed: int = 0) -> float:
    """Seconds to run `ids` through a text path made by `make()`, round by round: the engine's stop test on the
    generated ids, then the round's tokens pushed; the final flush included."""
    rng, text, at, generated = random.Random(seed), make(), 0, []
    t0 = time.perf_counter()
    while at < len(ids):
        chunk = ids[at : at + rng.randint(1, 5)]
        generated += chunk  # the engine's list of generated ids, grown round by round
        if text.stop_test(generated) is not None:
            raise AssertionError("a stop string that never occurs was found")
        text.push(chunk, accepted=len(chunk) - 1)
        at += len(chunk)
    text.finish()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", default="qwen2.5-coder-1.5b-instruct", help="a known model name or HF directory")
    ap.add_argument("--lengths", default="1024,2048,4096,8192,16384,32768")
    ap.add_argument("--reference-max", type=int, default=8192, help="the longest length the quadratic path runs")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from verispec.backends.loading import load_tokenizer

    tokenizer = load_tokenizer(args.tokenizer)
    lengths = [int(x) for x in args.lengths.split(",")]
    ids = corpus(tokenizer, max(lengths))
    rows = []
    for n in lengths:
        new = statistics.median(stream(lambda: ProvenanceText(tokenizer, STOPS), ids[:n]) for _ in range(args.repeats))
        old = (stream(lambda: ReferenceText(tokenizer, STOPS), ids[:n]) if n <= args.reference_max else None)
        rows.append({"tokens": n, "ms_per_token": new * 1e3 / n, "reference_ms_per_token": None if old is None
                     else old * 1e3 / n})
        print(f"{n:>6} tokens: {rows[-1]['ms_per_token']:.4f} ms/token"
              + ("" if old is None else f"; decoding everything each round {old * 1e3 / n:.4f} ms/token "
                                        f"({old / new:.1f}x)"), flush=True)
    base = rows[0]["ms_per_token"]
    for r in rows:
        r["vs_shortest"] = r["ms_per_token"] / base
    print(f"cost per token at {rows[-1]['tokens']} tokens / at {rows[0]['tokens']}: {rows[-1]['vs_shortest']:.2f}x")
    print(json.dumps({"tokenizer": args.tokenizer, "rows": rows}))


if __name__ == "__main__":
    main()
