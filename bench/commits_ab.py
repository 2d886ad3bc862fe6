"""Two commits of verispec, alternated in one run: is the newer one slower?

    python bench/commits_ab.py BASE [HEAD] [--pairs 2] [--limit 6] [--max-new-tokens 64] [--drafters D]
        [--prompts FILE]

Each commit is exported (git archive) to a temporary folder and run from this environment with PYTHONPATH set to
it, in the order A B B A A B ... so that the machine's drift falls on both alike. Per run: the default pipeline's
generate (one warm-up, then three generations of --generate-tokens on the same chat prompt; tokens/s and the
tokens themselves), and `verispec bench --limit N -k 4` (plain tokens/s, k = 4's aggregate speedup, acceptance and
mean accepted length, the median time to the first token of plain and speculative decoding), with the bench's
default drafter or `--drafters`. Prints each run, then each figure's median per commit and HEAD over BASE. Run it
alone: nothing else on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROMPT = [{"role": "user", "content": "Write a Python function that checks whether a number is prime."}]

GENERATE = """
import json, sys, verispec
assert verispec.__file__.startswith(sys.argv[1]), verispec.__file__
pipe = verispec.load()
prompt, n = json.loads(sys.argv[2]), int(sys.argv[3])
pipe.generate(prompt, max_new_tokens=16)
rates = []
for _ in range(3):
    c = pipe.generate(prompt, max_new_tokens=n)
    rates.append(c.stats.new_tokens / c.stats.seconds)
print(json.dumps({"tokens_per_second": rates, "token_ids": c.token_ids, "backend": pipe.backend, "k": pipe.k}))
"""


def export(rev: str, into: Path) -> Path:
    """The commit's tree, unpacked into `into/<rev>`."""
    dest = into / rev
    dest.mkdir()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], check=True, capture_output=True).stdout
    tar_path = into / f"{rev}.tar"
    tar_path.write_bytes(archive)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    return dest


def cli_module(tree: Path) -> str:
    apps_cli = (tree / "verispec/apps/cli.py").exists() or (tree / "verispec/apps/cli").is_dir()
    return "verispec.apps.cli" if apps_cli else "verispec.cli"


def run_one(tree: Path, args, out: Path) -> dict:
    full_env = {**os.environ, "PYTHONPATH": str(tree), "HF_HUB_OFFLINE": "1"}
    gen = subprocess.run([sys.executable, "-c", GENERATE, str(tree), json.dumps(PROMPT), str(args.generate_tokens)],
                         check=True, capture_output=True, text=True, env=full_env, cwd=tree)
    generated = json.loads(gen.stdout.strip().splitlines()[-1])
    chosen = [*(["--drafters", args.drafters] if args.drafters else []),
              *(["--prompts", str(Path(args.prompts).resolve())] if args.prompts else [])]
    subprocess.run([sys.executable, "-m", cli_module(tree), "bench", "--limit", str(args.limit), "-k", "4",
                    "--max-new-tokens", str(args.max_new_tokens), *chosen, "--json-out", str(out)],
                   check=True, capture_output=True, text=True, env=full_env, cwd=tree)
    configs = json.loads(out.read_text())["configs"]
    plain = next(c for c in configs if c["kind"] == "plain")["overall"]
    spec = next(c for c in configs if c["kind"] == "spec")["overall"]
    return {"first": generated["tokens_per_second"][0], "repeat": statistics.median(generated["tokens_per_second"][1:]),
            "token_ids": generated["token_ids"], "plain": plain["tokens_per_second"],
            "speedup": spec["speedup_aggregate"], "acceptance": spec["acceptance_rate"],
            "mean_accepted_length": spec["mean_accepted_length"], "ttft_plain": plain.get("ttft_median"),
            "ttft_spec": spec.get("ttft_median")}


FIGURES = ("first", "repeat", "plain", "speedup", "acceptance", "mean_accepted_length", "ttft_plain", "ttft_spec")


def _seconds(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f} s"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("base")
    ap.add_argument("head", nargs="?", default="HEAD")
    ap.add_argument("--pairs", type=int, default=2, help="A/B pairs (ordered A B, B A, A B, ...)")
    ap.add_argument("--limit", type=int, default=6, help="bench prompts")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="bench tokens per prompt")
    ap.add_argument("--generate-tokens", type=int, default=128)
    ap.add_argument("--drafters", help="the bench's drafter (default: the bench's own)")
    ap.add_argument("--prompts", help="the bench's prompt file (default: the bench's own)")
    args = ap.parse_args()
    revs = [subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", r], check=True, capture_output=True,
                           text=True).stdout.strip() for r in (args.base, args.head)]
    results: dict[str, list[dict]] = {rev: [] for rev in revs}
    with tempfile.TemporaryDirectory() as tmp:
        trees = {rev: export(rev, Path(tmp)) for rev in revs}
        for i in range(args.pairs):
            for rev in (revs if i % 2 == 0 else revs[::-1]):
                r = run_one(trees[rev], args, Path(tmp) / f"{rev}-{i}.json")
                results[rev].append(r)
                print(f"{rev} pair {i}: generate first {r['first']:.1f} tok/s, repeats {r['repeat']:.1f} tok/s; "
                      f"bench plain {r['plain']:.2f} tok/s, k=4 {r['speedup']:.3f}x, acceptance "
                      f"{r['acceptance']:.3f}, mean accepted length {r['mean_accepted_length']:.2f}, TTFT plain "
                      f"{_seconds(r['ttft_plain'])}, k=4 {_seconds(r['ttft_spec'])}", flush=True)
    base, head = (results[rev] for rev in revs)
    same = all(a["token_ids"] == b["token_ids"] for a, b in zip(base, head))
    print(f"\nmedians over {args.pairs} runs each; the generated tokens are {'the same' if same else 'DIFFERENT'}")
    print(f"{'figure':<22}{revs[0]:>10}{revs[1]:>10}{'head/base':>11}")
    for name in FIGURES:
        if any(r[name] is None for r in base + head):  # a commit whose bench has no such figure
            continue
        a, b = statistics.median(r[name] for r in base), statistics.median(r[name] for r in head)
        print(f"{name:<22}{a:>10.3f}{b:>10.3f}{b / a if a else float('nan'):>11.3f}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
