"""n choices of one long prompt, computed once (the other rows copy the first one's cache) against every row
prefilling the prompt itself, on the default target with a server's drafter (suffix), in one process.

    python bench/shared_prefill.py [--n 4] [--prompt-tokens 1500] [--trials 3] [--max-new-tokens 48] [--k 0]

Each trial's prompt is a chat turn holding HumanEval problems with their solutions (../shared/bench-data), cut to
about --prompt-tokens tokens, and a question about them; its n choices are sampled (temperature 0.7, seeds s .. s +
n - 1) as rows of one batch of the pipeline's engine (`Pipeline.batch(n)`), decoded plainly (k = 0: a seeded
choice's tokens then depend on its logits alone, which must be bitwise the same both ways; a drafter's drafts, which
depend on its batch mates' answers, would change its draws). Each trial runs both ways, in
alternating order, each on fresh caches and a fresh suffix history: shared (the engine as it is) and alone (no
row copies another's prompt: verispec.decoding.prefill.SHARED_PREFIX beyond any prompt). Prints per way the median
time until every choice has its first token, the median time of the whole request, the prompt tokens computed
(the prompt's tokens less those a row found cached) and whether every choice drew the same tokens both ways; then
the ratios alone / shared and one JSON line.
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import time
from pathlib import Path

import verispec
from verispec.core.sampling import SamplingParams
from verispec.decoding import prefill
from verispec.decoding.request import Request

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "bench-data" / "HumanEval.jsonl.gz"
QUESTIONS = ["Which of these functions could raise an exception on valid input? Explain briefly.",
             "Write one unit test for the last function above.",
             "Summarise what the second function does in two sentences."]


def prompts(tokenizer, n_tokens: int, trials: int) -> list[list[int]]:
    """Chat prompts of about n_tokens tokens: HumanEval problems and solutions, then a question."""
    with gzip.open(DATA, "rt") as f:
        problems = [json.loads(line) for line in f]
    out = []
    for t in range(trials):
        code, i = "", 7 * t
        while len(tokenizer(code)["input_ids"]) < n_tokens:
            code += problems[i % len(problems)]["prompt"] + problems[i % len(problems)]["canonical_solution"] + "\n"
            i += 1
        ids = tokenizer(code)["input_ids"][:n_tokens]
        messages = [{"role": "user", "content": tokenizer.decode(ids) + "\n\n" + QUESTIONS[t % len(QUESTIONS)]}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(tokenizer(text, add_special_tokens=False)["input_ids"])
    return out


def fresh(engine) -> None:
    """Empty caches and no suffix history: each run is a first request."""
    engine.reset()
    lookups = getattr(getattr(engine.drafter, "lookup", engine.drafter), "lookups", [])
    for history in {id(h): h for h in (getattr(lookup, "history", None) for lookup in lookups) if h}.values():
        history.clear()


def run(engine, prompt: list[int], n: int, seed: int, max_new: int, k: int | str) -> dict:
    fresh(engine)
    t0 = time.perf_counter()
    rows = [engine.add(Request(prompt_ids=tuple(prompt), params=SamplingParams(temperature=0.7, seed=seed + i),
                               max_new_tokens=max_new, k=k)) for i in range(n)]
    while engine.active:
        engine.step()
    seconds = time.perf_counter() - t0
    stats = [row.result.stats for row in rows]
    return {"first_tokens_seconds": max(s.first_token_seconds for s in stats), "seconds": seconds,
            "computed": sum(len(prompt) - s.cached_tokens for s in stats),
            "token_ids": [row.result.token_ids for row in rows]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4, help="choices of each prompt (rows of one batch)")
    ap.add_argument("--prompt-tokens", type=int, default=1500)
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--k", default="0", help="draft length of the choices (an integer or auto; default 0)")
    args = ap.parse_args()

    pipe = verispec.load(drafter="suffix")  # what a server runs: its requests share each pass
    engine = pipe.batch(args.n)
    shared_min = prefill.SHARED_PREFIX
    results = {"shared": [], "alone": []}
    for t, prompt in enumerate(prompts(pipe.tokenizer, args.prompt_tokens, args.trials)):
        order = ["shared", "alone"] if t % 2 == 0 else ["alone", "shared"]
        for way in order:
            prefill.SHARED_PREFIX = shared_min if way == "shared" else 10**9
            k = args.k if args.k == "auto" else int(args.k)
            results[way].append(run(engine, prompt, args.n, 100 * t, args.max_new_tokens, k))
        prefill.SHARED_PREFIX = shared_min
        last = {way: results[way][-1] for way in order}
        print(f"trial {t}: {len(prompt)} prompt tokens; " + "; ".join(
            f"{way} first tokens {r['first_tokens_seconds']:.2f} s, all {r['seconds']:.2f} s, {r['computed']} computed"
            for way, r in last.items()), flush=True)

    summary = {way: {key: statistics.median(r[key] for r in runs) for key in ("first_tokens_seconds", "seconds",
                                                                           "computed")}
               for way, runs in results.items()}
    same = sum(a["token_ids"] == b["token_ids"] for a, b in zip(results["shared"], results["alone"]))
    print(f"\n{'':8}{'first tokens (s)':>18}{'whole request (s)':>19}{'prompt tokens computed':>24}")
    for way, s in summary.items():
        print(f"{way:8}{s['first_tokens_seconds']:>18.2f}{s['seconds']:>19.2f}{s['computed']:>24.0f}")
    ratio_first = summary["alone"]["first_tokens_seconds"] / summary["shared"]["first_tokens_seconds"]
    ratio_all = summary["alone"]["seconds"] / summary["shared"]["seconds"]
    print(f"alone / shared: first tokens {ratio_first:.2f}x, whole request {ratio_all:.2f}x; "
          f"every choice the same both ways in {same}/{args.trials} trials")
    print(json.dumps({"n": args.n, "k": args.k, "backend": pipe.backend, "summary": summary,
                      "first_tokens_ratio": ratio_first, "whole_ratio": ratio_all, "identical_trials": same,
                      "trials": args.trials}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
