#!/usr/bin/env python3
"""The two orders of a linear layer's product on this machine (verispec.backends.linear): F.linear's x Wᵀ against
verispec's (W xᵀ)ᵀ, per row count, on the target's own layer shapes; then the whole target forward over n
new tokens on a warm cache (a verify pass over n - 1 drafts) with its layers in either order, against one
plain decoding step. Median of a few, both orders in one process, alternating.

    python bench/cpu_linear.py [--model qwen2.5-coder-1.5b-instruct] [--dtype fp32] [--rows 1,2,3,5,9,17,33]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn
from torch.nn import functional as F

from verispec.backends.linear import OrientedLinear, linear


def _median_ms(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def _set_order(model: nn.Module, oriented: bool) -> None:
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.__class__ = OrientedLinear if oriented else nn.Linear


def main() -> None:
    from verispec.backends import HFModel, Sequence
    from verispec.backends.loading import DTYPES, load_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b-instruct")
    ap.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    ap.add_argument("--rows", default="1,2,3,5,9,17,33")
    ap.add_argument("--context", type=int, default=300, help="tokens in the cache before each pass")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    torch.manual_seed(0)

    hf = load_model(args.model, torch.device("cpu"), DTYPES[args.dtype])
    layer = hf.model.layers[0]
    shapes = {"mlp gate": layer.mlp.gate_proj.weight, "mlp down": layer.mlp.down_proj.weight,
              "attn q": layer.self_attn.q_proj.weight, "lm head": hf.get_output_embeddings().weight}
    matmuls = []
    with torch.inference_mode():
        for name, w in shapes.items():
            for n in rows:
                x = torch.randn(n, w.shape[1], dtype=w.dtype)
                plain = _median_ms(lambda: F.linear(x, w), args.repeats)
                ours = _median_ms(lambda: linear(x, w), args.repeats)
                matmuls.append({"weight": name, "shape": list(w.shape), "rows": n, "x_wt_ms": round(plain, 2),
                                "w_xt_ms": round(ours, 2), "ratio": round(plain / ours, 2)})

        model = Sequence(HFModel(hf))
        ids = torch.randint(0, 30000, (args.context + max(rows),), generator=torch.Generator().manual_seed(1))
        model.forward(ids[: args.context])
        passes = {True: {}, False: {}}
        for _ in range(args.repeats):
            for oriented in (False, True):
                _set_order(hf, oriented)
                for n in rows:
                    t0 = time.perf_counter()
                    model.forward(ids[args.context : args.context + n])
                    passes[oriented].setdefault(n, []).append(time.perf_counter() - t0)
                    model.rollback(args.context)
    step = {o: statistics.median(passes[o][rows[0]]) for o in passes}
    forwards = [{"tokens": n, "x_wt_ms": round(1e3 * statistics.median(passes[False][n]), 1),
                 "w_xt_ms": round(1e3 * statistics.median(passes[True][n]), 1),
                 "x_wt_steps": round(statistics.median(passes[False][n]) / step[False], 2),
                 "w_xt_steps": round(statistics.median(passes[True][n]) / step[False], 2)} for n in rows]

    print(f"{'weight':<10} {'shape':<14} {'rows':>5} {'x Wt ms':>9} {'W xt ms':>9} {'ratio':>6}")
    for m in matmuls:
        print(f"{m['weight']:<10} {str(m['shape']):<14} {m['rows']:>5} {m['x_wt_ms']:>9} {m['w_xt_ms']:>9} "
              f"{m['ratio']:>6}")
    print(f"\ntarget forward over n tokens on a {args.context}-token cache ({args.dtype}); steps = x one plain "
          f"step in F.linear's order ({1e3 * step[False]:.1f} ms)")
    print(f"{'tokens':>6} {'x Wt ms':>9} {'W xt ms':>9} {'x Wt steps':>11} {'W xt steps':>11}")
    for f in forwards:
        print(f"{f['tokens']:>6} {f['x_wt_ms']:>9} {f['w_xt_ms']:>9} {f['x_wt_steps']:>11} {f['w_xt_steps']:>11}")
    print(json.dumps({"model": args.model, "dtype": args.dtype, "context": args.context, "matmuls": matmuls,
                      "forwards": forwards, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
