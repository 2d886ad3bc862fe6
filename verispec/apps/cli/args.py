"""The flags several commands share and the library values they become: the model and speculation flags
(a TargetSpec and DraftSpec, then a built pipeline), the sampling flags (SamplingParams, or an endpoint's request
fields), the argument types, and the help and error format of every parser.

A value the library refuses is a ValueError, which `main` reports as a usage error; `spec_errors` names the flag
at fault.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from verispec.apps.cli.errors import EXIT_USAGE, UsageError
from verispec.names.drafters import BACKEND_NAMES, DRAFT_FORWARDS, DRAFTER_NAMES, FREE_DRAFTERS, QUANT_MODES
from verispec.names.errors import ModelError
from verispec.names.k import parse_k
from verispec.names.options import (
    MAX_NEW_TOKENS,
    SamplingParams,
    option_defaults,
    option_types,
    sampling_options,
    to_openai,
)

BACKEND_CHOICES = ("auto", *BACKEND_NAMES)  # --backend, --draft-backend
QUANT_CHOICES = ("auto", *QUANT_MODES)  # --draft-quant


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


def add_subcommand(sub: argparse._SubParsersAction, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand's parser: its help line is also its description, and its help shows each flag's default."""
    return sub.add_parser(name, help=help, description=help, formatter_class=_HelpFormatter)


def add_model_args(p: argparse.ArgumentParser, speculation_flags: bool = True) -> None:
    p.add_argument("--target", help="target model: known name, HF directory, .gguf file or hub id (default: the "
                                    "default pair's target)")
    p.add_argument("--draft", help="draft model (same forms) (default: with no --target, the default pair's draft "
                                   "where the drafter takes one, or on llama.cpp SmolLM2-135M through hybrid-suffix "
                                   "for one user (not serve, nor -k 0); else none)")
    p.add_argument("--device", default="auto", type=_device_arg, help="auto, cpu, cuda or cuda:N")
    p.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16"],
                   help="weights dtype of models loaded through transformers; auto: bf16 where the device computes "
                        "in bf16 natively (CUDA, CPUs with AVX512-BF16 or AMX), else fp32 on a CPU")
    p.add_argument("--pull", action="store_true", help="install the default models if they are missing")
    p.add_argument("--backend", default="auto", choices=BACKEND_CHOICES,
                   help="target backend: hf (transformers), llamacpp (the GGUF file on llama.cpp; needs the "
                        "[llamacpp] extra) or auto: llamacpp on a CPU where it is installed and the target has a "
                        "GGUF, else hf")
    p.add_argument("--draft-backend", default="auto", choices=BACKEND_CHOICES,
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
                            "backend's default drafter, verispec.names.k.DEFAULTS, or its own pair with no --target "
                            "and no --draft, except for serve; model when --draft is given)")
        p.add_argument("--num-draft-tokens", "-k", type=k_arg, default=None,
                       help="draft tokens per round, or 'auto' (cost-aware adaptive k, 0..8) (default: the target "
                            "backend's default with its default drafter; else 4, or auto when the target or the "
                            "draft runs on llama.cpp, where a fixed k can be slower than plain decoding)")
        p.add_argument("--draft-quant", choices=QUANT_CHOICES, default="auto",
                       help="weight-only quantisation of the transformers draft (never the target; exactness "
                            "unaffected); auto: int4 on the CPU, none elsewhere")
        p.add_argument("--draft-vocab", type=non_negative_int, default=0, metavar="N",
                       help="the transformers draft scores only ~N frequent tokens (q = 0 elsewhere; exactness "
                            "unaffected), e.g. 32768; 0 = all")
        add_draft_forward_arg(p)
        add_tree_args(p)
        p.add_argument("--no-speculation", action="store_true", help="plain target decoding (the baseline)")


def add_tree_args(p: argparse.ArgumentParser, budgets: bool = False) -> None:
    p.add_argument("--tree", action="store_true",
                   help="token-tree speculation (--drafter tree): the draft model proposes a tree of candidates "
                        "and the target verifies all of them in one pass (transformers backend, lean path)")
    if budgets:
        p.add_argument("--tree-budget", default=None, metavar="LIST",
                       help="tree node budgets to compare, e.g. 8,16,auto; implies --tree (default: auto)")
    else:
        p.add_argument("--tree-budget", type=k_arg, default=None, metavar="N",
                       help="tree nodes per round, or 'auto' (measured cost and acceptance choose the budget and "
                            "depth each round); implies --tree (default: auto)")


def _add_color_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--color", action=argparse.BooleanOptionalAction, default=None,
                   help="colour each token by provenance: drafted and accepted (green, underlined) or produced "
                        "by the target (yellow) (default: on when stdout is a terminal)")


def add_draft_forward_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--draft-forward", default="auto", choices=DRAFT_FORWARDS,
                   help="how a transformers draft runs: lean (verispec's decode path for Llama/Qwen2/Mistral: "
                        "fused layers, preallocated cache) or transformers' own forward; auto: lean where the "
                        "architecture allows")


def k_arg(text: str) -> int | str:
    try:
        return parse_k(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def non_negative_int(text: str) -> int:
    value = _int_arg(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_int(text: str) -> int:
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


def add_sampling_args(p: argparse.ArgumentParser, max_new_tokens: int = MAX_NEW_TOKENS) -> None:
    """--max-new-tokens, a flag per sampling option (verispec.names.options: its default and help), --stop."""
    p.add_argument("--max-new-tokens", type=positive_int, default=max_new_tokens, metavar="N",
                   help="most tokens to generate")
    types, defaults = option_types(), option_defaults()
    for name, opt in sampling_options().items():
        if types[name] is bool:
            p.add_argument("--" + name.replace("_", "-"), action="store_true", help=opt.help)
            continue
        p.add_argument("--" + name.replace("_", "-"), type=_flag_type(types[name]), default=defaults[name],
                       help=opt.help)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable) (default: none)")


def add_generation_args(p: argparse.ArgumentParser) -> None:
    """The flags of a command that generates text: colour, models and speculation, sampling."""
    _add_color_arg(p)
    add_model_args(p)
    add_sampling_args(p)


def checked_sampling(args) -> SamplingParams:
    """The command line's sampling params, its speculation flags checked: usage errors before anything loads."""
    params = sampling_from_args(args)
    check_draft(args)
    return params


def _flag_type(annotation) -> type:
    """The parser of an option's values: int for `int` and `int | None`, else float."""
    return int if annotation is int or int in getattr(annotation, "__args__", ()) else float


def sampling_from_args(args) -> SamplingParams:
    """SamplingParams from the command line (a value it refuses, a ValueError, is a usage error)."""
    params = SamplingParams(**{name: getattr(args, name) for name in sampling_options()})
    params.check_length(args.max_new_tokens, "--max-new-tokens")
    return params


def endpoint_sampling(args) -> dict:
    """The OpenAI request fields for the command line's sampling settings and stops."""
    params = sampling_from_args(args)
    local = ["--" + name.replace("_", "-") for name in params.changed() if not sampling_options()[name].openai]
    if local:
        raise ValueError(f"{', '.join(local)}: not OpenAI request fields, so not sent to an endpoint")
    sampling = to_openai(params)
    if args.stop:
        sampling["stop"] = args.stop
    return sampling


_SPEC_FLAGS = {  # a spec field (SpecError.field) -> the flag that sets it
    "target.model": "--target", "target.backend": "--backend", "target.device": "--device", "target.dtype": "--dtype",
    "target.ctx_size": "--ctx-size", "target.exact_kernels": "--exact-kernels",
    "draft.model": "--draft", "draft.drafter": "--drafter", "draft.backend": "--draft-backend",
    "draft.quant": "--draft-quant", "draft.vocab": "--draft-vocab", "draft.forward": "--draft-forward",
    "draft.ctx_size": "--ctx-size", "draft": "--no-speculation", "k": "--num-draft-tokens", "pull": "--pull",
}


@contextlib.contextmanager
def spec_errors():
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


def model_specs(args, drafter: str | None, serving: bool = False, k: int | str | None = None):
    """(TargetSpec, DraftSpec or None) from the model options; `drafter` None: plain decoding; `serving`: the
    defaults of a server, whose requests share each pass, and `k` the draft length asked for (see default_refs)."""
    from verispec.assembly.resolve import default_refs
    from verispec.assembly.specs import DraftSpec, TargetSpec

    target, draft, drafter = default_refs(args.target, args.draft, drafter, args.pull, args.backend, args.device,
                                          serving, k)
    target_spec = TargetSpec(target, args.backend, args.device, None if args.dtype == "auto" else args.dtype,
                             args.ctx_size, exact_kernels=args.exact_kernels)
    if drafter is None:
        return target_spec, None
    return target_spec, DraftSpec(drafter, None if drafter in FREE_DRAFTERS else draft, args.draft_backend,
                                  args.draft_quant, args.draft_vocab, args.draft_forward, args.ctx_size)


def pipeline_from_args(args, serving: bool = False):
    from verispec.assembly.build import build

    drafter = None if args.no_speculation else args.drafter or "auto"
    with spec_errors():
        target, draft = model_specs(args, drafter, serving, args.num_draft_tokens)
        return build(target, draft, 0 if args.no_speculation else args.num_draft_tokens)


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


def check_draft(args) -> None:
    """A model drafter named on the command line needs a draft: --draft, or the default pair's (when --target
    is not given). The default drafter is the backend's, known once the backend is: build checks it."""
    _tree_flags(args)
    if (not args.no_speculation and args.drafter is not None and args.drafter not in FREE_DRAFTERS
            and args.target is not None and args.draft is None):
        raise UsageError("no draft model: pass --draft (or --drafter ngram, or --no-speculation for plain decoding)")


def use_color(args) -> bool:
    """--color / --no-color; unset: colour when stdout is a terminal."""
    return sys.stdout.isatty() if args.color is None else args.color


def stderr_console():
    from rich.console import Console

    return Console(stderr=True)
