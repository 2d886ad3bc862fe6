"""The llama.cpp kernel bake-off: c(n) = the cost of a pass over n new tokens / the cost of one, n = 1..16, on a
warm cache, for each way this machine can run a GGUF (the default target's unless --model), with c(1) in ms
beside each ratio: a configuration that makes c(1) slower must win it back end to end.

Every configuration runs in a process of its own (llama.cpp reads its kernel switches once per process), all
loaded at once; the passes take turns across configurations and widths in a shuffled order each repeat, so
that the machine's drift falls on all of them alike, and each cell is the median over the repeats.

    default            verispec's build as verispec runs it: multi-column kernels for every pass (the best
                       variant this CPU runs), repacked weights, flash attention (one-token attention not split
                       across threads), every core
    avx2               default with the kernels' AVX2 variant (VERISPEC_GGML_MULTICOL_ISA=avx2): what a CPU
                       without AVX512-VNNI runs (the same as default on such a CPU)
    one-sweep          default with every column of a pass in one sweep over the weights
                       (VERISPEC_GGML_MULTICOL_SWEEP=0), where default sweeps a wide pass 64 columns at a time
    exact              the same with batch-invariant kernels (--exact-kernels)
    stock              llama.cpp's own kernels in the same build (VERISPEC_GGML_MULTICOL=0,
                       VERISPEC_GGML_FA_SPLIT_KV=1): repacked Q4_K GEMM on groups of 4 columns, one-column Q6_K
                       dot products, the tiled kernel from 8 tokens, split-KV one-token attention
    stock-no-repack    stock, weights not repacked (use_extra_bufts false)
    stock-tiled        stock with the tiled VNNI kernel forced for every width (GGML_CPU_TILED_MM_FORCE=1)
    stock-no-repack-tiled  both
    split-kv           default, one-token flash attention split across threads over long contexts (stock)
    no-flash-attn      default without flash attention
    threads-1          default on one thread

llama.cpp's AMX kernels are a build, not a switch: a build made with `make install-llamacpp LLAMA_AMX=1` where
the CPU runs AMX tiles runs them in every configuration above; the last lines say whether each build does, and
if not, why. `--build NAME=DIR` runs every configuration also on another llama-cpp-python build in the same run
(DIR first on the path of those processes, e.g. `pip install --no-deps --target DIR <wheel>`): rows CONFIG@NAME.

Prints a table and, last, one JSON line.

Usage: python bench/llama_kernels.py [--model qwen2.5-coder-1.5b-instruct] [--context 300] [--widths 1-16]
           [--repeats 7] [--configs default,stock,...] [--build NAME=DIR ...] [--json-out out/llama_kernels.json]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import multiprocessing as mp
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from verispec.backends.llamacpp import (ENV_EXACT, ENV_MULTICOL, ENV_MULTICOL_ISA, ENV_MULTICOL_SWEEP, ENV_SPLIT_KV,
                                        EXACT_WIDTH, kernels)
from verispec.catalog import DEFAULT_TARGET

ROOT = Path(__file__).resolve().parent.parent
# After a pass, llama.cpp's OpenMP threads spin for a while before they sleep: a process answers only once its
# threads are idle, so that they take no cycles from the next configuration's pass.
SETTLE = 0.02


@dataclass(frozen=True)
class Config:
    """One way to run the model: process-wide switches (`env`), and the model's own options."""

    env: dict[str, str] = field(default_factory=dict)
    repack: bool = True
    flash_attn: bool = True
    threads: int | None = None
    site: str | None = None  # a directory holding another llama-cpp-python build, put first on the path


STOCK = {ENV_MULTICOL: "0", ENV_SPLIT_KV: "1"}
CONFIGS = {
    "default": Config(),
    "avx2": Config({ENV_MULTICOL_ISA: "avx2"}),
    "one-sweep": Config({ENV_MULTICOL_SWEEP: "0"}),
    "exact": Config({ENV_EXACT: str(EXACT_WIDTH)}),
    "stock": Config(STOCK),
    "stock-no-repack": Config(STOCK, repack=False),
    "stock-tiled": Config({**STOCK, "GGML_CPU_TILED_MM_FORCE": "1"}),
    "stock-no-repack-tiled": Config({**STOCK, "GGML_CPU_TILED_MM_FORCE": "1"}, repack=False),
    "split-kv": Config({ENV_SPLIT_KV: "1"}),
    "no-flash-attn": Config(flash_attn=False),
    "threads-1": Config(threads=1),
}


@contextlib.contextmanager
def weights_not_repacked():
    """llama-cpp-python takes its model parameters from llama_model_default_params() and has no option for
    use_extra_bufts: open models with that default turned off."""
    import llama_cpp

    default = llama_cpp.llama_cpp.llama_model_default_params

    def params():
        p = default()
        p.use_extra_bufts = False
        return p

    llama_cpp.llama_cpp.llama_model_default_params = params
    try:
        yield
    finally:
        llama_cpp.llama_cpp.llama_model_default_params = default


def worker(conn, model_path: str, config: Config, context: int, widest: int) -> None:
    """Serve timing requests for one configuration: (n, offset) -> seconds of a pass over n tokens (at most
    `widest`; their ids start at 2000 + offset) at `context`; None ends the worker."""
    os.environ.update(config.env)
    if config.site is not None:
        if "llama_cpp" in sys.modules:
            raise RuntimeError("llama_cpp was imported before the build's directory was put on the path")
        sys.path.insert(0, config.site)
    import torch

    from verispec.backends.base import Sequence
    from verispec.backends.llamacpp import LlamaCppModel

    with weights_not_repacked() if not config.repack else contextlib.nullcontext():
        model = Sequence(LlamaCppModel(model_path, n_ctx=context + widest, n_threads=config.threads,
                                       flash_attn=config.flash_attn))
    model.forward(torch.arange(1000, 1000 + context), last_only=True)
    conn.send(build_line())
    while True:
        request = conn.recv()
        if request is None:
            return
        n, offset = request
        tokens = torch.arange(2000 + offset, 2000 + offset + n)
        t0 = time.perf_counter()
        model.forward(tokens)
        seconds = time.perf_counter() - t0
        model.rollback(context)
        time.sleep(SETTLE)
        conn.send(seconds)


def amx_unavailable() -> str:
    """Why this build has no AMX kernels: the AMX probe's answer on this machine."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe"
        built = subprocess.run(["cc", "-O1", "-mamx-tile", "-mamx-int8", str(ROOT / "native" / "amx_probe.c"),
                                "-o", str(probe)], capture_output=True, text=True)
        if built.returncode != 0:
            return "the compiler cannot build AMX code"
        run = subprocess.run([str(probe)], capture_output=True, text=True)
        if run.returncode != 0:
            return run.stdout.strip()
    return "the CPU runs AMX tiles, but this llama-cpp-python was built without them (make install-llamacpp LLAMA_AMX=1)"


def build_line() -> str:
    """What the llama-cpp-python build of this process runs, and whether AMX (if not, why)."""
    build = kernels()
    amx = "this build runs llama.cpp's AMX kernels" if build.amx else f"no AMX kernels: {amx_unavailable()}"
    return f"{build.describe()}; {amx}"


def answer(name: str, workers: dict) -> float | str:
    """The next answer of configuration `name`'s worker; SystemExit naming the configuration if it died."""
    proc, conn = workers[name]
    try:
        return conn.recv()
    except EOFError:
        proc.join()
        raise SystemExit(f"configuration {name}: its process died (exit code {proc.exitcode})") from None


def parse_widths(text: str) -> list[int]:
    widths: list[int] = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        widths.extend(range(int(lo), int(hi or lo) + 1))
    if 1 not in widths:
        widths.insert(0, 1)
    return sorted(set(widths))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_TARGET, help="a known name or a .gguf file")
    ap.add_argument("--context", type=int, default=300, help="tokens already in the cache")
    ap.add_argument("--widths", default="1-16", help="pass widths, e.g. 1-16 or 1,2,5,9")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(CONFIGS)}")
    ap.add_argument("--build", action="append", default=[], metavar="NAME=DIR",
                    help="also run every configuration on the llama-cpp-python build in DIR (rows CONFIG@NAME)")
    ap.add_argument("--seed", type=int, default=0, help="the order the passes take turns in")
    ap.add_argument("--json-out", default=None)
    args = ap.parse_args()
    from verispec.backends.loading import resolve_gguf

    names = args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        ap.error(f"unknown configuration(s) {', '.join(unknown)} (use {', '.join(CONFIGS)})")
    configs = {name: CONFIGS[name] for name in names}
    for spec in args.build:
        label, _, site = spec.partition("=")
        if not label or not os.path.isdir(os.path.join(site, "llama_cpp")):
            ap.error(f"--build takes NAME=DIR, DIR holding a llama_cpp package; got {spec!r}")
        configs |= {f"{name}@{label}": dataclasses.replace(CONFIGS[name], site=site) for name in names}
    widths = parse_widths(args.widths)
    path = resolve_gguf(args.model)
    ctx = mp.get_context("spawn")
    workers, builds = {}, {}
    for name, config in configs.items():
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=worker, args=(child, path, config, args.context, widths[-1]), daemon=True)
        proc.start()
        child.close()  # the worker's end: a worker that dies ends the parent's recv (EOFError)
        workers[name] = (proc, parent)
        builds.setdefault(config.site, answer(name, workers))
    print(f"# {path}, {args.context} tokens cached, {args.repeats} repeats, configurations loaded: "
          f"{', '.join(workers)}", flush=True)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in widths} for name in workers}
    rng = random.Random(args.seed)
    for repeat in range(args.repeats):
        order = [(name, n) for name in workers for n in widths]
        rng.shuffle(order)
        for name, n in order:
            _, conn = workers[name]
            conn.send((n, repeat))
            times[name][n].append(answer(name, workers))
    for proc, conn in workers.values():
        conn.send(None)
        proc.join()
    base = statistics.median(times["default"][1]) if "default" in times else None
    rows = {}
    for name in workers:
        ms = {n: statistics.median(v) * 1000 for n, v in times[name].items()}
        rows[name] = {"c1_ms": ms[1], "c": {n: ms[n] / ms[1] for n in widths},
                      "c1_vs_default": ms[1] / (base * 1000) if base else None}
    head = f"{'configuration':<22} {'c(1) ms':>8} {'vs dflt':>7} " + " ".join(f"{n:>5}" for n in widths)
    print(head)
    for name, row in rows.items():
        rel = f"{row['c1_vs_default']:.2f}" if row["c1_vs_default"] is not None else "-"
        print(f"{name:<22} {row['c1_ms']:>8.1f} {rel:>7} " + " ".join(f"{row['c'][n]:>5.2f}" for n in widths))
    labels = {None: "this environment's build"} | {site: f"@{label}" for label, _, site in
                                                   (spec.partition("=") for spec in args.build)}
    for site, line in builds.items():
        print(f"# {labels[site]}: {line}")
    result = {"model": path, "context": args.context, "repeats": args.repeats, "widths": widths,
              "configs": rows, "builds": {labels[site]: line for site, line in builds.items()}}
    if args.json_out:
        Path(args.json_out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
