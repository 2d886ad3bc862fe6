"""`verispec bench`: plain decoding and speculative configurations on one prompt set in the same process, or
OpenAI-compatible servers (--endpoint); a table, one JSON line, optionally a JSON file and plots.

The flags map onto verispec.apps.bench: `plan` turns the lists compared into configurations and describes the
run, the harness measures, `report` aggregates; an interrupted or failed run still writes what it measured."""

from __future__ import annotations

import argparse
import os

from verispec.apps.cli.args import (
    QUANT_CHOICES,
    add_draft_forward_arg,
    add_model_args,
    add_sampling_args,
    add_subcommand,
    add_tree_args,
    model_specs,
    non_negative_int,
    positive_int,
    sampling_from_args,
    spec_errors,
    stderr_console,
)
from verispec.apps.cli.bench_common import (
    bench_outcome,
    bench_prompts,
    check_json_out,
    command_line,
    emit_json,
    print_table,
)
from verispec.apps.cli.bench_endpoints import cmd_bench_endpoints
from verispec.apps.cli.errors import one_line, require_extra
from verispec.names.drafters import DRAFTER_NAMES
from verispec.names.errors import ModelError
from verispec.names.k import default_drafter, parse_k, unasked_k
from verispec.names.options import BENCH_MAX_NEW_TOKENS


def add_parser(sub: argparse._SubParsersAction) -> None:
    b = add_subcommand(sub, "bench", "plain vs speculative decoding, same run: tables, JSON, plots")
    b.add_argument("--prompts", help="Spec-Bench/MT-Bench jsonl, HumanEval jsonl(.gz) or text file (default: "
                                     "the built-in set)")
    b.add_argument("--turn", type=positive_int, default=1, metavar="N",
                   help="time the Nth user turn of multi-turn questions (MT-Bench: 2 = second turns), the "
                        "earlier turns and their answers in the context; the answers are the target's plain "
                        "greedy decoding (with --endpoint: the first endpoint's), not timed; questions with "
                        "fewer turns are left out (default: 1)")
    b.add_argument("--warm-history", action="store_true",
                   help="with --turn 2 or later: each run first answers the previous turn itself, untimed, so "
                        "that the timed turn starts with the conversation in its caches, as in a chat (default: "
                        "the whole conversation is prefilled in the timed run)")
    b.add_argument("--limit", type=positive_int, metavar="N", help="at most N prompts (default: all)")
    b.add_argument("--per-category", type=positive_int, metavar="N",
                   help="at most N prompts per category (default: all)")
    b.add_argument("--categories", help="only these categories, e.g. code-editing,summarization (default: all)")
    b.add_argument("--num-draft-tokens", "-k", help="k values to compare, e.g. 2,4,6,auto (default: what `generate` "
                                                    "runs with the drafters compared: the backend's default k with "
                                                    "its default drafter, else auto on llama.cpp and 4 elsewhere)")
    b.add_argument("--drafters", help="drafters to compare, e.g. model,ngram,hybrid (default: what `generate` runs "
                                      "on the target's backend: suffix on llama.cpp, hybrid-suffix with "
                                      "SmolLM2-135M there when neither --target nor --draft is given; model on "
                                      "transformers and wherever --draft is given)")
    b.add_argument("--compare", action="append", default=[], choices=["hf", "hf-lookup", "llama", "llama-lookup"],
                   help="also run an external reference: hf = Hugging Face assisted generation, "
                        "hf-lookup = its prompt lookup decoding, llama = llama-cpp-python's own decoding of the "
                        "target's GGUF, llama-lookup = its prompt lookup decoding (repeatable) (default: none)")
    b.add_argument("--endpoint", action="append", default=[], metavar="[NAME=]URL",
                   help="benchmark an OpenAI-compatible server instead of local configurations (repeatable; "
                        "interleaved prompt by prompt, the first is the baseline), e.g. "
                        "verispec=http://127.0.0.1:8000/v1 (default: none)")
    b.add_argument("--endpoint-api-key", help="bearer token sent to the endpoints (default: none)")
    b.add_argument("--rounds-only", action="store_true",
                   help="time verispec's decoding rounds alone, without turning tokens into text (default: the "
                        "text too, detokenising and stop checks, as a user gets it)")
    b.add_argument("--concurrency", type=positive_int, default=None, metavar="N",
                   help="with --endpoint: N requests in flight (1: one after another), each endpoint alone in turn; "
                        "reports aggregate tokens/s (start each run on fresh servers: verispec's suffix drafter "
                        "remembers answers) (default: the endpoints interleaved prompt by prompt)")
    b.add_argument("--json", action="store_true",
                   help="stdout carries only the JSON report (one line); the table goes to stderr")
    b.add_argument("--json-out", metavar="FILE",
                   help="also write the JSON report to FILE, whole or not at all; also when the run is "
                        "interrupted or fails (default: none)")
    b.add_argument("--plot-dir", help="write PNG plots here (default: none)")
    b.add_argument("--warmup", type=non_negative_int, default=1, help="warm-up generations per configuration")
    b.add_argument("--repeats", type=int, default=1,
                   help="runs per prompt and configuration, interleaved and pooled (total tokens / total seconds) "
                        "before the ratio: single runs on a noisy machine swing by +-10-15%%")
    b.add_argument("--draft-quant", choices=QUANT_CHOICES, default="auto",
                   help="weight-only quantisation of the transformers draft (auto: int4 on the CPU); HF assisted "
                        "generation always gets the bf16 draft, its library default")
    b.add_argument("--draft-vocab", type=non_negative_int, default=0, metavar="N",
                   help="the draft scores only ~N frequent tokens (HF assisted keeps the full head); 0 = all")
    add_draft_forward_arg(b)
    b.add_argument("--draft-variants", metavar="LIST", type=_draft_variants_arg,
                   help="more draft setups compared in the same run, e.g. llamacpp,hf-int4,hf-int4-v32768 "
                        "(backend[-quant][-vVOCAB][-lean|-transformers]); shown as model[variant] / "
                        "hybrid[variant] (default: none)")
    add_tree_args(b, budgets=True)
    add_model_args(b, speculation_flags=False)
    add_sampling_args(b, BENCH_MAX_NEW_TOKENS)
    b.set_defaults(func=cmd_bench)


def _draft_variants_arg(text: str) -> str:
    """--draft-variants: each variant parses (the text itself is kept)."""
    from verispec.apps.bench.harness import parse_draft_variant

    for variant in (v.strip() for v in text.split(",") if v.strip()):
        try:
            parse_draft_variant(variant)
        except ModelError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _k_list(text: str, flag: str = "--num-draft-tokens") -> list[int | str]:
    """Comma-separated k values (or tree budgets), each >= 1 or 'auto'; `flag` names them in an error."""
    try:
        ks = [parse_k(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes integers or 'auto' separated by commas, got {text!r}") from None
    if not ks or any(k != "auto" and k < 1 for k in ks):
        raise ValueError(f"{flag} needs values >= 1 or 'auto', got {text!r}")
    return ks


def _generate_defaults(args) -> tuple[str, str, str | None, str | None]:
    """(--drafters, -k, --draft, a note saying where they came from), each where not given what `generate` runs on
    the target's backend: that backend's default drafter, or its own pair with the default target (the pair's draft
    then returned), and the k build would choose (verispec.names.k.unasked_k)."""
    if args.drafters is not None and args.num_draft_tokens is not None:
        return args.drafters, args.num_draft_tokens, args.draft, None
    from verispec.assembly.resolve import default_refs, resolve_target_backend
    from verispec.assembly.specs import TargetSpec

    with spec_errors():
        target, draft, drafter = default_refs(args.target, args.draft, "auto" if args.drafters is None else None,
                                              args.pull, args.backend, args.device)
        backend, _ = resolve_target_backend(TargetSpec(target, args.backend, args.device))
    pair = drafter not in (None, "auto")  # the default target's own pair
    drafters = args.drafters
    if drafters is None:
        drafters = drafter if pair else default_drafter(backend, args.draft is not None)
    draft_backend = None if args.draft_backend == "auto" else args.draft_backend
    draft = draft if pair else args.draft
    k = args.num_draft_tokens or str(unasked_k(backend, drafters, draft, draft_backend, args.drafters is not None))
    told = f"--drafters {drafters}" + (f" --draft {draft}" if pair else "") + f" -k {k}"
    return drafters, k, draft, f"{told}: what `generate` runs on the {backend} backend"


def _compared(args) -> tuple[list[str], list[str], list[int | str]]:
    """(drafters, draft variants, tree budgets) from --drafters, --draft-variants and --tree/--tree-budget; each
    checked before anything loads."""
    from verispec.apps.bench.harness import parse_draft_variant

    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    for d in drafters:
        if d not in DRAFTER_NAMES:
            raise ValueError(f"unknown drafter '{d}' in --drafters (use {', '.join(DRAFTER_NAMES)})")
    variants = [v.strip() for v in (args.draft_variants or "").split(",") if v.strip()]
    with spec_errors():
        for v in variants:
            parse_draft_variant(v)  # refuse a bad one before loading anything
    tree = args.tree or args.tree_budget is not None
    budgets = _k_list(args.tree_budget or "auto", "--tree-budget") if tree else []
    return drafters, variants, budgets


def _measure(bench, prompts: list, configs: list, params, args) -> tuple[list, str, str | None]:
    """Run the benchmark under a progress bar (a line per run when stderr is not a terminal): (the runs
    measured, status, error). An interruption or a failure after the first run ends it with what it has."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from verispec.apps.bench.harness import run_benchmark

    console = stderr_console()
    progress = Progress(TextColumn("bench"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[last]}"),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                        disable=not console.is_terminal)
    total = len(prompts) * (1 + len(configs))
    runs: list = []  # what was measured, kept as it comes: an interrupted or failed run still reports it

    def on_run(r) -> None:
        runs.append(r)
        state = f"{r.tokens_per_second:.1f} tok/s" if r.ok else f"FAILED: {r.error}"
        last = f"{r.category}/{r.config}: {state}"
        progress.update(task, advance=1, last=last)
        if not console.is_terminal:  # a log file: one line per run instead of a bar drawn only at the end
            console.print(f"bench {len(runs)}/{total} {r.prompt_id} {last}", highlight=False, markup=False,
                          soft_wrap=True)

    status, error = "complete", None
    with progress:
        task = progress.add_task("bench", total=total, last="warm-up")
        try:
            with spec_errors():
                run_benchmark(bench, prompts, configs, params, args.max_new_tokens, warmup=args.warmup,
                              on_run=on_run, repeats=args.repeats, warm_history=args.warm_history)
        except KeyboardInterrupt:
            status = "interrupted"
        except Exception as exc:
            if (isinstance(exc, ValueError) and not runs) or os.environ.get("VERISPEC_TRACEBACK"):
                raise  # refused before measuring anything: a usage error, no report
            status, error = "failed", one_line(exc)
    return runs, status, error


def cmd_bench(args) -> int:
    check_json_out(args.json_out)
    if args.plot_dir:
        require_extra("bench", "verispec bench --plot-dir", ("matplotlib",))
    if args.warm_history and args.turn < 2:
        raise ValueError("--warm-history needs --turn 2 or later (a turn with a conversation before it)")
    if args.endpoint:
        return cmd_bench_endpoints(args)
    if args.concurrency is not None:
        raise ValueError("--concurrency loads servers: it needs --endpoint")
    from verispec.apps.bench.harness import Bench, Config
    from verispec.apps.bench.plan import caveats, configurations, metadata, needs_draft_model
    from verispec.apps.bench.report import build_report, render_table, write_plots

    params = sampling_from_args(args)
    args.drafters, args.num_draft_tokens, args.draft, defaults = _generate_defaults(args)
    ks = _k_list(args.num_draft_tokens)
    prompts = bench_prompts(args)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    drafters, variants, budgets = _compared(args)
    configs = configurations(drafters, ks, variants, budgets, args.compare)
    drafter = "model" if needs_draft_model(drafters, budgets, args.compare) else "ngram"
    with spec_errors():
        target_spec, draft_spec = model_specs(args, drafter)
        bench = Bench(target_spec, draft_spec, text=not args.rounds_only)
        pipe = bench.pipeline(Config("own", "spec", ks[0], drafter))  # for the header
        other_tokenizer = "hf" in args.compare and bool(bench.hf_assistant_tokenizers())  # before measuring
    if pipe.fim is None and not args.prompts and any(p.infill for p in prompts):  # the built-in set's infills
        prompts = [p for p in prompts if not p.infill]
        stderr_console().print("bench: the fill-in-the-middle prompts are left out: the target has no FIM tokens",
                                highlight=False, markup=False, soft_wrap=True)
    runs, status, error = _measure(bench, prompts, configs, params, args)
    meta = metadata(command_line(), pipe, draft_spec.label if draft_spec is not None else None, params,
                    max_new_tokens=args.max_new_tokens, prompts_file=args.prompts, turn=args.turn,
                    warm_history=args.warm_history, repeats=args.repeats, draft_vocab=args.draft_vocab,
                    variants=variants, rounds_only=args.rounds_only, status=status, error=error)
    report = build_report(runs, configs, meta)
    report["caveats"] = caveats(args.compare, params, other_tokenizer)
    if defaults:
        report["defaults"] = defaults
        stderr_console().print(f"bench: {defaults}", highlight=False, markup=False, soft_wrap=True)
    print_table(render_table(report), args.json)
    for line in report["failures"]:
        stderr_console().print(f"failed: {line}", highlight=False, markup=False, soft_wrap=True)
    for line in report["caveats"]:
        stderr_console().print(f"note: {line}", highlight=False, markup=False, soft_wrap=True)
    plot_error = None
    if args.plot_dir:
        try:
            report["plots"] = [str(p) for p in write_plots(report, args.plot_dir)]
        except Exception as exc:  # the measurements matter more: the JSON is written all the same
            plot_error = report["plot_error"] = one_line(exc)
    emit_json(report, args.json_out)
    return bench_outcome(status, error, plot_error, len(runs))
