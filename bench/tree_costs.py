#!/usr/bin/env python3
"""What a token tree costs on this machine, per node count: the default pair's target verifying a tree of n
nodes (one tree-masked forward over the root and n nodes, on a ~300-token cache) against one plain decoding
step, and the draft's forward over a frontier of w nodes against its one-token step. Median of a few, in one
process; the k policy (verispec.decoding.policies.tree_budget) weighs these same costs when it picks a tree's budget and depth.

    python bench/tree_costs.py [--dtype fp32] [--nodes 1,2,4,8,12,16,24,32] [--widths 1,2,4,8] [--json-out FILE]

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from verispec.backends.base import Sequence
from verispec.core.timing import sync


def _chain_tree(n: int, width: int = 4):
    """A tree of n nodes in the shape the drafter grows: `width` children under the best node of each depth."""
    from verispec.core.tree import ROOT, TokenTree

    parents, tokens, last = [], [], ROOT
    while len(parents) < n:
        first = len(parents)
        for c in range(min(width, n - len(parents))):
            parents.append(last)
            tokens.append(100 + len(parents))
        last = first
    return TokenTree(torch.tensor(tokens, dtype=torch.long), parents)


def _prefill(model, context: int, seed: int) -> torch.device:
    """A fresh cache of `context` random tokens; returns the model's device."""
    model.reset()
    Sequence(model).forward(torch.randint(0, 30000, (context,), generator=torch.Generator().manual_seed(seed))
                            .to(model.device))
    return model.device


def _pass_seconds(model, tokens, positions, visible, context: int, repeats: int = 5) -> float:
    """Median seconds of one tree pass appended to the `context`-token cache (rolled back after each), the
    first run left out (warm-up)."""
    times = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        model.forward_tree(0, tokens, positions, context, visible, int(positions.max()))
        model.rollback(0, context)
        sync(model.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def tree_pass_costs(model, nodes: list[int], context: int = 300) -> list[dict]:
    """Seconds of one tree verify pass per node count (n = 0: the plain step, one token)."""
    device, rows = _prefill(model, context, 0), []
    for n in [0, *nodes]:
        tree = _chain_tree(n)
        tokens = torch.cat([torch.tensor([11]), tree.tokens]).to(device)
        positions = (context + torch.tensor([0, *tree.depths], dtype=torch.long)).to(device)
        visible = torch.cat([torch.ones(n + 1, 1, dtype=torch.bool), tree.paths()], dim=1).to(device)
        rows.append({"nodes": n, "seconds": _pass_seconds(model, tokens, positions, visible, context)})
    for r in rows:
        r["vs_plain"] = r["seconds"] / rows[0]["seconds"]
    return rows


def frontier_costs(model, widths: list[int], context: int = 300) -> list[dict]:
    """Seconds of one draft forward over a frontier of w nodes (w = 1: a chain's draft step)."""
    device, rows = _prefill(model, context, 1), []
    for w in widths:
        tokens = torch.arange(200, 200 + w, device=device)
        positions = torch.full((w,), context, dtype=torch.long, device=device)
        visible = torch.eye(w, dtype=torch.bool, device=device)
        rows.append({"width": w, "seconds": _pass_seconds(model, tokens, positions, visible, context)})
    for r in rows:
        r["vs_one"] = r["seconds"] / rows[0]["seconds"]
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="fp32", choices=["bf16", "fp32"])
    parser.add_argument("--nodes", default="1,2,4,8,12,16,24,32")
    parser.add_argument("--widths", default="1,2,4,8")
    parser.add_argument("--json-out")
    args = parser.parse_args()
    import verispec

    pipe = verispec.load(backend="hf", drafter="tree", dtype=args.dtype)
    target, draft = pipe.engine.target, pipe.draft_model
    verify = tree_pass_costs(target, [int(x) for x in args.nodes.split(",")])
    steps = frontier_costs(draft, [int(x) for x in args.widths.split(",")])
    print(f"target ({args.dtype}) verify pass over the root + n tree nodes, x one plain step:")
    for r in verify:
        print(f"  n = {r['nodes']:>2}: {r['seconds'] * 1000:7.1f} ms  {r['vs_plain']:.2f}x")
    print(f"draft ({pipe.draft_quant}) forward over a frontier of w nodes, x one draft step:")
    for r in steps:
        print(f"  w = {r['width']:>2}: {r['seconds'] * 1000:7.1f} ms  {r['vs_one']:.2f}x")
    step_over_plain = steps[0]["seconds"] / verify[0]["seconds"]
    print(f"one draft step = {step_over_plain:.3f} of a plain target step")
    report = {"dtype": args.dtype, "draft_quant": pipe.draft_quant, "verify": verify, "frontier": steps,
              "draft_step_over_plain": step_over_plain}
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
