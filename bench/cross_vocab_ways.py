#!/usr/bin/env python3
"""How a draft of another tokenizer drafts sampled rows: over the shared tokens (the draft's distribution
restricted to them), by text (the draft's argmax re-tokenised, one-hot), or auto (per request, the way accepted
more so far), each against plain decoding of the same prompts in the same process (`verispec bench`'s harness:
interleaved, balanced orders), printing tokens/s, acceptance, mean accepted length and speedups.

    python bench/cross_vocab_ways.py [--backend llamacpp] [--draft smollm2-135m-instruct] [--limit 10]
        [--max-new-tokens 96] [--temperature 0.7] [--prompts ../shared/bench-data/HumanEval.jsonl.gz]
"""

from __future__ import annotations

import argparse

from rich.console import Console

from verispec.apps.bench.harness import Bench, Config, run_benchmark
from verispec.apps.bench.loader import load_prompts
from verispec.apps.bench.report import build_report, render_table
from verispec.assembly.build import build
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.catalog import DEFAULT_TARGET
from verispec.core.sampling import SamplingParams
from verispec.proposers.cross_vocab import SAMPLED_WAYS, CrossVocabDraft, sampled_way


def pair_args(ap: argparse.ArgumentParser, limit: int, max_new: int) -> None:
    """The arguments this script and bench/sampled_logprobs.py share: the pair, its backend, the prompts, sampling."""
    ap.add_argument("--target", default=DEFAULT_TARGET)
    ap.add_argument("--draft", default="smollm2-135m-instruct")
    ap.add_argument("--backend", default="llamacpp", choices=("llamacpp", "hf"))
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--prompts", default="../shared/bench-data/HumanEval.jsonl.gz")
    ap.add_argument("--limit", type=int, default=limit)
    ap.add_argument("--max-new-tokens", type=int, default=max_new)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("-k", type=int, default=4)


class WaysBench(Bench):
    """A Bench whose spec configurations are named after a way of drafting sampled rows."""

    def pipeline(self, config: Config):
        if config.kind != "spec":
            return super().pipeline(config)
        key = ("way", config.name)
        if key not in self._pipelines:
            pipe = build(self.target, self.draft_spec(config), config.k, store=self.store)
            drafter = pipe.engine.drafter
            if not isinstance(drafter, CrossVocabDraft):
                raise SystemExit("the draft shares the target's tokenizer: there is no way to choose")
            drafter.sampled = config.name
            self._pipelines[key] = pipe
        return self._pipelines[key]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair_args(ap, limit=10, max_new=96)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--ways", default=",".join(SAMPLED_WAYS))
    args = ap.parse_args()
    try:
        for way in args.ways.split(","):
            sampled_way(way)
    except ValueError as exc:
        ap.error(str(exc))

    target = TargetSpec(args.target, backend=args.backend, dtype=args.dtype)
    draft = DraftSpec("model", args.draft, backend=args.backend)
    bench = WaysBench(target, draft)
    configs = [Config(way, "spec", args.k, "model") for way in args.ways.split(",")]
    prompts = load_prompts(args.prompts)[: args.limit]
    params = SamplingParams(temperature=args.temperature, seed=args.seed)
    runs = run_benchmark(bench, prompts, configs, params, args.max_new_tokens)
    meta = dict(target=args.target, draft=args.draft, backend=args.backend, draft_backend=args.backend,
                device=str(bench.baseline.device), dtype=bench.baseline.dtype, sampling=f"T={args.temperature}")
    Console(width=200).print(render_table(build_report(runs, configs, meta)))


if __name__ == "__main__":
    main()
