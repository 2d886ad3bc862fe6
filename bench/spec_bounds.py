"""How fast could speculation be here? The best any k policy can do with each drafter, on these prompts, at this
machine's costs measured in this process: the ceiling that tells a policy's shortfall from the drafter's or
the backend's (see bench/bounds.py for how rounds are worked out from plain decoding).

Measured: each prompt's plain greedy decoding and prefill; the target's pass over n = 1 .. k_max + 1 new tokens
on a warm cache (median of --repeats); a draft model's one-token step and its prefill of each prompt. A first
round's drafts ride in the pass that feeds the prompt: each is priced at the prefill's mean seconds per prompt
token. Reported
per drafter, as decode time (after the prefill) and end to end (prefill included) over plain decoding:

    oracle        every round's drafter and k chosen knowing its outcome: no policy over these drafters beats it
    fixed k       the same k every round (the best k)
    per source    one k per draft source ('suffix' / 'suffix-short', 'ngram' / 'ngram-short', 'model'), the best
                  such table in hindsight: what a policy that learns per source at best converges to
    cost-aware k  (free drafters) verispec's own k policy, replayed over the prompts in order at the measured
                  costs: its choices without the machine's timing noise
    ceiling       (with a draft model) every draft accepted, at the draft's step cost: no draft model, chain or
                  tree, can beat it; end to end once with the draft's prefill, once without any

A row pays the draft model's prefill of a prompt only where it drafts with the model there (an oracle: only
where that wins the prefill back); the free drafters prefill nothing.
Prints a table and, last, one JSON line.

Usage: python bench/spec_bounds.py --prompts ../shared/bench-data/HumanEval.jsonl.gz --limit 20 \
           [--backend llamacpp] [--drafters suffix,ngram,model] [--draft-backend llamacpp] [--max-new-tokens 96]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from bounds import (  # bench/bounds.py, beside this script
    Costs,
    Text,
    acceptance_per_depth,
    free_rounds,
    mean_accepted_length,
    model_rounds,
    oracle_seconds,
    per_source_policy,
    per_source_table,
    perfect_rounds,
    policy_seconds,
    simulate,
    trace_seconds,
)

import verispec
from verispec.apps.bench.loader import answer_history, load_prompts, select
from verispec.backends.base import Sequence, common_prefix_length
from verispec.core.sampling import SamplingParams
from verispec.core.timing import sync
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.pipeline.text import encode_messages, encode_prompt
from verispec.proposers.draft_model import align_vocab
from verispec.proposers.ngram import NgramProposer
from verispec.proposers.suffix import SuffixProposer

FREE = {"suffix": SuffixProposer, "ngram": NgramProposer}


def pass_costs(models: dict[str, tuple[object, range]], context: int, repeats: int) -> dict[str, dict[int, float]]:
    """Median seconds of each model's forward over n new tokens on a warm cache of `context` tokens, for each n
    of its range. The widths and models take turns within each repeat, so that a machine's drift over the
    measurement weighs on every width alike instead of skewing their ratios."""
    for model, _ in models.values():
        model.reset()
        model.forward(torch.arange(1000, 1000 + context, device=model.device), last_only=True)
    times: dict[str, dict[int, list[float]]] = {name: {n: [] for n in widths} for name, (_, widths) in models.items()}
    for r in range(repeats + 1):  # the first round pays for planning or allocation of new widths: dropped
        for name, (model, widths) in models.items():
            for n in widths:
                t0 = time.perf_counter()
                model.forward(torch.arange(3000, 3000 + n, device=model.device))
                sync(model.device)
                if r:
                    times[name][n].append(time.perf_counter() - t0)
                model.rollback(context)
    for model, _ in models.values():
        model.reset()
    return {name: {n: statistics.median(ts) for n, ts in by_n.items()} for name, by_n in times.items()}


def timed_forward(model, ids: list[int], warm: list[int]) -> float:
    """Seconds of a model's prefill of ids, the part it shares with `warm` already in its cache."""
    model.reset()
    shared = min(common_prefix_length(warm, ids), len(ids) - 1)
    if shared:
        model.forward(torch.tensor(ids[:shared], device=model.device), last_only=True)
    sync(model.device)
    t0 = time.perf_counter()
    model.forward(torch.tensor(ids[shared:], device=model.device), last_only=True)
    sync(model.device)
    return time.perf_counter() - t0


def decode_texts(pipe, prompts, max_new: int, warm_history: bool, draft) -> list[Text]:
    tok = pipe.tokenizer
    texts = []
    for p in prompts:
        ids = encode_messages(tok, p.messages()) if p.history else encode_prompt(tok, p.text, p.chat)
        # the conversation before this turn, the last answer included (the cache keeps what they share with ids)
        warm = encode_messages(tok, p.messages()[:-1]) if warm_history and p.history else []
        pipe.engine.reset()
        if warm:  # the conversation so far in the target's cache, as in a chat: only the new turn is prefilled
            pipe.engine.generate(warm, SamplingParams(), max_new_tokens=1, k=0)
        result = pipe.engine.generate(ids, SamplingParams(), max_new_tokens=max_new, k=0)
        budget = min(max_new, pipe.engine.target.max_length - len(ids))  # as the engine caps it
        cached = min(common_prefix_length(warm, ids), len(ids) - 1)  # what the engine kept of the warm cache
        text = Text(ids, result.token_ids, budget, cached, result.stats.prefill_seconds)
        text.decode = result.stats.seconds - result.stats.prefill_seconds  # plain decoding as timed
        if draft is not None:
            text.draft_prefill = timed_forward(draft, ids, warm)
        texts.append(text)
        print(f"# {p.id}: {len(ids)} prompt tokens, {len(text.output)} generated, prefill {text.prefill:.2f} s"
              + (f", draft prefill {text.draft_prefill:.2f} s" if draft is not None else ""), flush=True)
    return texts


def add_rounds(texts: list[Text], drafters: list[str], draft, vocab_size: int, k_max: int) -> None:
    for name in drafters:
        proposer = FREE[name]() if name in FREE else None  # one for all texts: its history carries, as in a process
        for t in texts:
            if proposer is not None:
                t.rounds[name] = free_rounds(proposer, t, k_max)
                continue
            draft.reset()
            logits = draft.forward(torch.tensor(t.prompt + t.output, device=draft.device))
            guesses = align_vocab(logits, vocab_size).argmax(dim=-1).tolist()
            t.rounds[name] = model_rounds(guesses, t, k_max)
        if draft is not None:
            draft.reset()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--limit", type=int)
    ap.add_argument("--per-category", type=int)
    ap.add_argument("--categories", help="comma-separated categories to keep")
    ap.add_argument("--turn", type=int, default=1)
    ap.add_argument("--warm-history", action="store_true",
                    help="a later turn's earlier conversation is in the caches, as in a chat: only the new turn is "
                         "prefilled")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--dtype")
    ap.add_argument("--drafters", default="suffix,ngram", help="of suffix, ngram, model")
    ap.add_argument("--draft-backend", default="auto")
    ap.add_argument("--draft-quant", default="auto")
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=7, help="timings per measured pass cost (median)")
    ap.add_argument("--json-out")
    args = ap.parse_args()
    drafters = [d for d in args.drafters.split(",") if d]
    unknown = [d for d in drafters if d not in (*FREE, "model")]
    if unknown:
        ap.error(f"unknown drafter '{unknown[0]}' (suffix, ngram, model)")

    use_model = "model" in drafters
    pipe = verispec.load(drafter="model" if use_model else None, k=0, backend=args.backend, dtype=args.dtype,
                         draft_backend=args.draft_backend, draft_quant=args.draft_quant)
    draft = None if pipe.draft_model is None else Sequence(pipe.draft_model)
    print(f"# target: {pipe.backend} ({pipe.reason}); draft: {pipe.draft_backend or '-'} {pipe.draft_quant}",
          flush=True)
    prompts = select(load_prompts(args.prompts, turn=args.turn), args.limit, args.per_category)
    if args.categories:
        keep = set(args.categories.split(","))
        prompts = [p for p in prompts if p.category in keep]
    prompts = answer_history(prompts, lambda p: pipe.generate(p.messages(), max_new_tokens=args.max_new_tokens,
                                                              k=0).text)
    texts = decode_texts(pipe, prompts, args.max_new_tokens, args.warm_history, draft)

    context = int(statistics.median(len(t.prompt) + len(t.output) // 2 for t in texts))
    models = {"target": (Sequence(pipe.engine.target), range(1, args.k_max + 2))}
    if use_model:
        models["model"] = (draft, range(1, 2))
    measured = pass_costs(models, context, args.repeats)
    verify = measured["target"]
    prefill_token = sum(t.prefill for t in texts) / sum(t.fed for t in texts)  # a first round's draft rides in it
    costs = Costs(verify, {"model": measured["model"][1]} if use_model else {}, prefill_token)
    step = verify[1]
    print(f"# target pass over n tokens, x one token ({step * 1e3:.1f} ms): "
          + ", ".join(f"{n}: {verify[n] / step:.2f}" for n in verify))
    print(f"# prefill {prefill_token * 1e3:.2f} ms a prompt token = {prefill_token / step:.3f} of a target step "
          "(the price of a first round's draft)")
    if use_model:
        print(f"# draft step {costs.steps['model'] * 1e3:.1f} ms = {costs.steps['model'] / step:.3f} of a target step")
    add_rounds(texts, drafters, draft, pipe.engine.target.vocab_size, args.k_max)

    def speedups(sub: list[Text], per_text: list[tuple[float, float]]) -> dict[str, float]:
        """From each text's (decode seconds, draft prefill seconds it pays): decode and end-to-end speedups."""
        plain, prefill = sum(costs.plain(t) for t in sub), sum(t.prefill for t in sub)
        decode = sum(d for d, _ in per_text)
        return {"decode_speedup": plain / decode,
                "e2e_speedup": (plain + prefill) / (decode + prefill + sum(p for _, p in per_text))}

    def oracle(t: Text, names: list[str], priced: Costs = costs, model_prefill: bool = True) -> tuple[float, float]:
        """The oracle's (decode, draft prefill) on a text: a draft model's prefill is paid only where drafting
        with it wins it back, the free drafters (or plain decoding) deciding the rest."""
        free = [n for n in names if n in FREE]
        without = oracle_seconds(t, free, priced, args.k_max)
        if len(free) == len(names):
            return without, 0.0
        paid = t.draft_prefill if model_prefill else 0.0
        used = oracle_seconds(t, names, priced, args.k_max)
        return (used, paid) if used + paid < without else (without, 0.0)

    def policy(t: Text, choose) -> tuple[float, float]:
        """A policy's (decode, draft prefill): the prefill is paid where the policy drafts with the model."""
        trace = simulate(t, choose)
        uses = any(drafter == "model" and drafted for _, drafter, drafted, _ in trace)
        return trace_seconds(trace, costs), t.draft_prefill if uses else 0.0

    report: dict = {"context": context, "plain_step_ms": step * 1e3, "prompts": len(texts),
                    "tokens": sum(len(t.output) for t in texts), "verify_x_step": {n: v / step for n, v in verify.items()},
                    "draft_step_x": costs.steps.get("model", 0.0) / step,
                    "prefill_token_x": prefill_token / step,
                    "prefill_s": sum(t.prefill for t in texts), "draft_prefill_s": sum(t.draft_prefill for t in texts),
                    "plain_decode_s": sum(costs.plain(t) for t in texts), "drafters": {}}
    report["plain_decode_timed_s"] = sum(t.decode for t in texts)
    print(f"\nplain decoding: {report['plain_decode_s']:.1f} s at the measured step ({report['plain_decode_timed_s']:.1f} s "
          f"as timed), prefill {report['prefill_s']:.1f} s, {report['tokens']} tokens")
    print("| drafter | policy | decode speedup | end-to-end speedup |")
    print("|---|---|---|---|")

    def row(name: str, policy: str, entry: dict) -> dict:
        print(f"| {name} | {policy} | {entry['decode_speedup']:.2f}x | {entry['e2e_speedup']:.2f}x |")
        return entry

    for name in drafters:
        model = name == "model"
        rounds = [r for t in texts for r in t.rounds[name]]
        entry: dict = {"mean_accepted_length": mean_accepted_length(rounds),
                       "acceptance_per_depth": acceptance_per_depth(rounds, min(6, args.k_max))}
        entry["oracle"] = row(name, "oracle", speedups(texts, [oracle(t, [name]) for t in texts]))
        fixed = {k: speedups(texts, [policy(t, lambda i, k=k, name=name: (name, k)) for t in texts])
                 for k in range(1, args.k_max + 1)}
        best_k = max(fixed, key=lambda k: fixed[k]["e2e_speedup"])
        entry["fixed"] = {"k": best_k, **row(name, f"fixed k = {best_k}", fixed[best_k])}
        table = per_source_table(texts, name, costs, args.k_max)
        entry["per_source"] = {"k": table, **row(name, "per source " + ", ".join(f"{s}: {k}" for s, k in table.items()),
                                                 speedups(texts, [policy(t, per_source_policy(t, name, table))
                                                                  for t in texts]))}
        if model:
            for t in texts:
                t.rounds["perfect"] = perfect_rounds(t, args.k_max)
            perfect = Costs(verify, {"perfect": costs.steps["model"]}, prefill_token).envelope()
            entry["ceiling"] = row(name, "ceiling: every draft accepted", speedups(
                texts, [oracle(t, ["perfect"], perfect) for t in texts]))
            entry["ceiling_no_draft_prefill"] = row(name, "ceiling, no draft prefill", speedups(
                texts, [oracle(t, ["perfect"], perfect, model_prefill=False) for t in texts]))
        else:
            replayed = CostAwareK(k_max=args.k_max)
            entry["cost_aware_k"] = row(name, "cost-aware k, replayed", speedups(
                texts, [(policy_seconds(t, name, replayed, costs), 0.0) for t in texts]))
        report["drafters"][name] = entry
    if len(drafters) > 1:
        report["oracle_all"] = row("+".join(drafters), "oracle, the best drafter each round",
                                   speedups(texts, [oracle(t, drafters) for t in texts]))
        if use_model:
            report["oracle_all_no_draft_prefill"] = row(
                "+".join(drafters), "the same, the draft's prefill free",
                speedups(texts, [oracle(t, drafters, model_prefill=False) for t in texts]))

    print("\n| drafter | mean accepted length (k_max drafts) | acceptance per depth |")
    print("|---|---|---|")
    for name, entry in report["drafters"].items():
        print(f"| {name} | {entry['mean_accepted_length']:.2f} | "
              f"{' '.join(f'{a:.2f}' for a in entry['acceptance_per_depth'])} |")

    categories = sorted({p.category for p in prompts})
    if len(categories) > 1:
        print("\nper category, end to end (decode): " + ", ".join(drafters) + (", all" if len(drafters) > 1 else ""))
        report["per_category"] = {}
        for cat in categories:
            sub = [t for p, t in zip(prompts, texts) if p.category == cat]
            cells = {name: speedups(sub, [oracle(t, [name]) for t in sub]) for name in drafters}
            if len(drafters) > 1:
                cells["all"] = speedups(sub, [oracle(t, drafters) for t in sub])
            report["per_category"][cat] = cells
            print(f"  {cat}: " + ", ".join(f"{c['e2e_speedup']:.2f}x ({c['decode_speedup']:.2f}x)" for c in cells.values()))
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(report, f, indent=1)
    print(json.dumps(report))


if __name__ == "__main__":
    main()
