"""The `verispec` command. Thin: parses arguments and calls the library; one module per command (generate,
chat, bench, serve, export, models), each adding its subparser, the flags they share in `args`.

Exit status: 0 done; 1 the command failed while running (a model missing or unloadable, generation failed,
a file unreadable); 2 the command line is invalid (an unknown flag, a value out of range or that the library
refuses); 130 interrupted. An error is one line on stderr, `verispec: error: ...`; VERISPEC_TRACEBACK=1 shows
the traceback of an unexpected one.

Parsing imports no transformers or rich (nor any backend): each command imports what it needs when it runs, so
that `verispec --help` and a usage error answer at once.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings

from verispec.apps.cli import bench, chat, export, generate, models, serve
from verispec.apps.cli.args import _HelpFormatter, _Parser
from verispec.apps.cli.errors import EXIT_FAILURE, EXIT_INTERRUPTED, EXIT_USAGE, one_line
from verispec.names import __version__

__all__ = ["build_parser", "main"]

COMMANDS = (generate, chat, bench, serve, export, models)  # in the order `verispec --help` lists them


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="verispec", description="Lossless speculative decoding.", formatter_class=_HelpFormatter)
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def _quiet_libraries() -> None:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def _warn_on_one_line(message, category, filename, lineno, file=None, line=None) -> None:
    print(f"verispec: warning: {' '.join(str(message).split())}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run one command; returns the exit status (see the module docstring)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help, --version, or a usage error argparse has already printed
        return 0 if exc.code is None else exc.code if isinstance(exc.code, int) else EXIT_USAGE
    _quiet_libraries()
    warnings.showwarning = _warn_on_one_line
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("verispec: interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception as exc:
        if os.environ.get("VERISPEC_TRACEBACK"):
            raise
        print(f"verispec: error: {one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE if isinstance(exc, ValueError) else EXIT_FAILURE
