"""What the local and the endpoint benchmarks share: the prompt set the flags select, the command line a report
records, and handing the report over: the table for people (stdout, or stderr when stdout carries only the JSON),
one JSON line for scripts, the same document written to a file whole or not at all, and the exit status that says
how the run ended."""

from __future__ import annotations

import json
import os
import sys
import tempfile

from verispec.apps.cli.errors import EXIT_INTERRUPTED, CommandError, UsageError


def bench_prompts(args) -> list:
    """The prompts that --prompts, --turn, --categories, --limit and --per-category select; none is an error."""
    from verispec.apps.bench.loader import load_prompts, select

    prompts = load_prompts(args.prompts, turn=args.turn)
    if args.categories:
        wanted = {c.strip() for c in args.categories.split(",") if c.strip()}
        unknown = wanted - {p.category for p in prompts}
        if unknown:
            have = sorted({p.category for p in prompts})
            raise ValueError(f"no prompts in categories {sorted(unknown)} (have: {have})")
        prompts = [p for p in prompts if p.category in wanted]
    prompts = select(prompts, args.limit, args.per_category)
    if not prompts:
        raise ValueError("no prompts selected")
    return prompts


def command_line() -> str:
    """The command as the report records it: as typed when run as `verispec`, else `verispec bench`."""
    return "verispec " + " ".join(sys.argv[1:]) if sys.argv and sys.argv[0].endswith("verispec") else "verispec bench"


def bench_outcome(status: str, error: str | None, plot_error: str | None, measured: int) -> int:
    """The exit status of a benchmark whose report is written; a failure says so in one line."""
    if status == "interrupted":
        print(f"verispec: interrupted: the report holds the {measured} runs measured before", file=sys.stderr)
        return EXIT_INTERRUPTED
    if status == "failed":
        raise CommandError(f"{error} (the report holds the {measured} runs measured before)")
    if plot_error:
        raise CommandError(f"writing the plots failed: {plot_error}")
    return 0


def print_table(table, json_only: bool) -> None:
    """The table for people: on stdout, or on stderr when stdout carries only the JSON."""
    from rich.console import Console

    Console(width=200, stderr=json_only).print(table)


def check_json_out(json_out: str | None) -> None:
    """Refuse a --json-out that cannot be written before measuring anything."""
    if json_out and not os.path.isdir(os.path.dirname(os.path.abspath(json_out))):
        raise UsageError(f"--json-out {json_out}: no such directory")


def emit_json(report: dict, json_out: str | None) -> None:
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
