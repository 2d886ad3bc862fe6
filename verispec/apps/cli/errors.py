"""How a command fails: the exit statuses, the two errors a command raises on purpose, and any exception as
the one line `verispec: error: ...` shows."""

from __future__ import annotations

from verispec.names.errors import ModelError, exception_line

EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130


class UsageError(ValueError):
    """The command line asks for something invalid (exit status 2)."""


class CommandError(RuntimeError):
    """The command failed while running (exit status 1); the message says why."""


# an optional part of the package -> the modules it installs (pyproject.toml's optional dependencies)
EXTRAS = {"serve": ("fastapi", "uvicorn", "prometheus_client", "pydantic"), "bench": ("httpx", "matplotlib")}


def require_extra(extra: str, what: str, modules: tuple[str, ...] | None = None) -> None:
    """CommandError (one line) when the [extra] part of the package that `what` needs is not installed (only
    `modules` of it, where given)."""
    import importlib.util

    missing = [m for m in (modules or EXTRAS[extra]) if importlib.util.find_spec(m) is None]
    if missing:
        raise CommandError(f"{what} needs verispec's [{extra}] extra ({', '.join(missing)} not installed): "
                           f"pip install 'verispec[{extra}]'")


def one_line(exc: BaseException) -> str:
    """An exception as one line: its message's first line, after its type unless it is one of ours (a bad
    value, a model problem, a command failure), whose messages are written for users."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else ""
    if isinstance(exc, (ValueError, ModelError, CommandError)) and text:
        return text
    return exception_line(exc)
