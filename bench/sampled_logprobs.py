#!/usr/bin/env python3
"""What a sampled decoder emits, scored by the target: the mean log-probability, under the target's processed
distribution, of each token emitted over seeded samples, with its standard error, for plain decoding, verispec
with a draft (each way a draft of another tokenizer drafts sampled rows) and, on transformers, transformers' own
assisted generation with the same draft (its different-tokenizer generator when the tokenizers differ). A lossless
decoder's mean agrees with plain decoding's within the errors (the spread of the samples' means); one that accepts
drafts the target would not emit falls below it. (The exactness tests are the chi-square tests on tiny models;
this is the real pair's check.)

    python bench/sampled_logprobs.py [--backend llamacpp|hf] [--draft smollm2-135m-instruct] [--limit 6]
        [--seeds 3] [--max-new-tokens 48] [--temperature 0.7]
"""

from __future__ import annotations

import argparse
import math
import statistics

import torch
from cross_vocab_ways import pair_args  # bench/, beside this script

from verispec.apps.bench.harness import Bench
from verispec.apps.bench.loader import load_prompts
from verispec.assembly.build import build
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.core.sampling import SamplingParams
from verispec.decoding.request import Request
from verispec.names.options import to_transformers
from verispec.pipeline.text import encode_prompt
from verispec.proposers.cross_vocab import SAMPLED_WAYS, CrossVocabDraft


def hf_assisted(bench: Bench, ids: list[int], params: SamplingParams, max_new: int, seed: int) -> list[float]:
    """Transformers' assisted generation of the target with the bench's draft, each new token scored by the target
    (log-softmax of its logits at the temperature)."""
    model = bench.baseline.engine.target.model
    x = torch.tensor([ids], device=bench.baseline.device)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                             assistant_model=bench.hf_draft(), **bench.hf_assistant_tokenizers(),
                             eos_token_id=sorted(bench.baseline.engine.eos_token_ids) or None,
                             **to_transformers(params))
        new = out[0, len(ids):]
        logits = model(out).logits[0, len(ids) - 1 : -1].float() / params.temperature
    return logits.log_softmax(-1)[torch.arange(len(new)), new].tolist()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    pair_args(ap, limit=6, max_new=48)
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()

    bench = Bench(TargetSpec(args.target, backend=args.backend, dtype=args.dtype),
                  DraftSpec("model", args.draft, backend=args.backend))
    plain = bench.baseline
    spec = build(bench.target, bench.draft, args.k, store=bench.store)
    ways = SAMPLED_WAYS if isinstance(spec.engine.drafter, CrossVocabDraft) else ("same tokenizer",)
    arms = ["plain"] + [f"verispec {w}" for w in ways] + (["transformers assisted"] if args.backend == "hf" else [])
    prompts = load_prompts(args.prompts)[: args.limit]
    print(f"{args.target} <- {args.draft} on {args.backend}, T = {args.temperature}, {len(prompts)} prompts x "
          f"{args.seeds} seeds x {args.max_new_tokens} tokens")
    for arm in arms:
        logprobs: list[float] = []
        means: list[float] = []  # one per sample: tokens within a sample are not independent
        for p in prompts:
            ids = encode_prompt(plain.tokenizer, p.text, p.chat)
            for seed in range(args.seeds):
                params = SamplingParams(temperature=args.temperature, seed=seed)
                if arm == "transformers assisted":
                    sample = hf_assisted(bench, ids, params, args.max_new_tokens, seed)
                    logprobs += sample
                    means.append(statistics.mean(sample))
                    continue
                pipe = plain if arm == "plain" else spec
                if isinstance(pipe.engine.drafter, CrossVocabDraft):
                    pipe.engine.drafter.sampled = arm.split()[-1]
                pipe.engine.reset()
                out = pipe.engine.generate(Request(prompt_ids=tuple(ids), params=params,
                                                   max_new_tokens=args.max_new_tokens, logprobs=0))
                logprobs += [lp for lp, _ in out.logprobs]
                means.append(statistics.mean(lp for lp, _ in out.logprobs))
        mean = statistics.mean(logprobs)
        err = statistics.stdev(means) / math.sqrt(len(means)) if len(means) > 1 else float("nan")
        rare = sum(lp < math.log(1e-4) for lp in logprobs)
        print(f"{arm:>24}: mean log p {mean:7.3f} +- {err:.3f} (over {len(means)} samples' means), "
              f"{len(logprobs)} tokens; p < 1e-4: {rare}", flush=True)


if __name__ == "__main__":
    main()
