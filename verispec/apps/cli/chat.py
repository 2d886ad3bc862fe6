"""`verispec chat`: a multi-turn conversation, each answer streamed and followed by its acceptance statistics
(the loop itself is verispec.apps.repl's)."""

from __future__ import annotations

import argparse
import sys

from verispec.apps.cli.args import add_generation_args, add_subcommand, checked_sampling, pipeline_from_args, use_color


def add_parser(sub: argparse._SubParsersAction) -> None:
    c = add_subcommand(sub, "chat", "multi-turn chat with streaming answers and acceptance statistics")
    c.add_argument("--system", help="system message (default: none)")
    c.add_argument("--measure-plain", action="store_true",
                   help="after each answer, also time plain decoding of it and show the speedup")
    add_generation_args(c)
    c.set_defaults(func=cmd_chat)


def cmd_chat(args) -> int:
    from verispec.apps.chat import ChatBot
    from verispec.apps.repl import run_repl

    params = checked_sampling(args)
    pipe = pipeline_from_args(args)
    bot = ChatBot(pipe, system_prompt=args.system, params=params, max_new_tokens=args.max_new_tokens,
                  stop=tuple(args.stop), measure_plain=args.measure_plain)
    interactive = sys.stdin.isatty()
    k = pipe.k
    draft = {"none": "no speculation", "ngram": f"n-gram drafts (k={k})", "suffix": f"suffix drafts (k={k})"}.get(
        pipe.drafter, f"{pipe.drafter} drafter, draft {pipe.draft_ref} on {pipe.draft_backend} (k={k})")
    banner = f"verispec chat: target {pipe.target_ref} on {pipe.backend}, {draft}, {pipe.device}"
    return run_repl(bot, interactive, banner, color=use_color(args))
