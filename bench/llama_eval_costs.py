"""Cost of one llama.cpp eval over n new tokens (n = 1..9) for the default pair's GGUFs, as verispec's
llama.cpp backend runs them (flash attention on, all cores): the physics behind speculation on llama.cpp.
Usage: python bench/llama_eval_costs.py [--repeats 8] [--context 256]"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.backends.base import Sequence
from verispec.backends.llamacpp import LlamaCppModel
from verispec.backends.loading import resolve_gguf
from verispec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--context", type=int, default=256, help="tokens already in the cache")
    args = ap.parse_args()
    for name in (DEFAULT_TARGET, DEFAULT_DRAFT):
        model = Sequence(LlamaCppModel(resolve_gguf(name), n_ctx=2048))
        model.forward(torch.arange(1000, 1000 + args.context), last_only=True)
        base = None
        row = []
        for n in range(1, 10):
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                model.forward(torch.arange(2000 + r, 2000 + r + n))
                times.append(time.perf_counter() - t0)
                model.rollback(args.context)
            ms = statistics.median(times) * 1000
            base = base or ms
            row.append(f"{n}: {ms:.0f} ms ({ms / base:.2f}x)")
        print(f"{name}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
