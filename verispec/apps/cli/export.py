"""`verispec export`: print the launch command of vLLM, SGLang or llama-server for the same target, draft and
speculation settings; it loads nothing, only locates the models as that engine needs them."""

from __future__ import annotations

import argparse
import shlex

from verispec.apps.cli.args import add_subcommand, k_arg, non_negative_int
from verispec.apps.cli.errors import UsageError
from verispec.names.errors import ModelError


def add_parser(sub: argparse._SubParsersAction) -> None:
    ex = add_subcommand(sub, "export", "the launch command for vLLM, SGLang or llama-server with the same speculative "
                                 "settings (for more GPUs, machines or users than one process serves)")
    ex.add_argument("engine", choices=["vllm", "sglang", "llama-server"])
    ex.add_argument("--target", help="target model: known name (its cached HF directory, or GGUF for llama-server), "
                                     "HF directory, .gguf file or hub id (default: the default pair's target)")
    ex.add_argument("--draft", help="draft model (same forms) (default: the default pair's draft when --target is "
                                    "not given, else none)")
    ex.add_argument("--drafter", default="model", choices=["model", "ngram", "hybrid"],
                    help="model: the draft LM; ngram: prompt lookup; hybrid: exported as the draft LM")
    ex.add_argument("--num-draft-tokens", "-k", type=k_arg, default=4,
                    help="draft tokens per round, or 'auto' (exported as 4: no engine has cost-aware k)")
    ex.add_argument("--draft-vocab", type=non_negative_int, default=0, metavar="N",
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


def cmd_export(args) -> int:
    from verispec.apps.export import ExportSpec, export, locate
    from verispec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET

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
