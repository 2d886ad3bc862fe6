#!/usr/bin/env python3
"""One draft step (one new token on a warm cache) of the default draft on verispec's lean path, per draft
quantisation, on this machine: what `--draft-quant` buys here. Median of a few; float32 weights by default
(what `--dtype auto` loads on a CPU without native bf16).

    python bench/draft_step.py [--dtype fp32] [--context 200] [--repeats 12] [--quants int4,int8,none]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from verispec.assembly.registry import BACKENDS, LoadRequest
from verispec.backends.base import Sequence
from verispec.backends.loading import DTYPES
from verispec.catalog import DEFAULT_DRAFT


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--context", type=int, default=200, help="tokens already in the cache")
    ap.add_argument("--repeats", type=int, default=12)
    ap.add_argument("--quants", default="int4,int8,none")
    args = ap.parse_args()
    for quant in args.quants.split(","):
        request = LoadRequest(DEFAULT_DRAFT, torch.device("cpu"), DTYPES[args.dtype], quant=quant, forward="lean")
        model = Sequence(BACKENDS["hf"].load(request)[0])
        with torch.inference_mode():
            model.forward(torch.arange(100, 100 + args.context), last_only=True)
            times = []
            for r in range(args.repeats):
                t0 = time.perf_counter()
                model.forward(torch.tensor([1000 + r]), last_only=True)
                times.append(time.perf_counter() - t0)
                model.rollback(args.context)
        print(f"{DEFAULT_DRAFT} {args.dtype} {quant}: {1e3 * statistics.median(times):.1f} ms a step", flush=True)
        del model


if __name__ == "__main__":
    main()
