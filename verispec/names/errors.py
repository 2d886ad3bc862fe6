"""The errors a caller sees, each a one-line message: a model or the cache failing (ModelError), a specification
refused (SpecError: it names the field at fault and settings that would be accepted instead)."""

from __future__ import annotations

from typing import Any


class ModelError(RuntimeError):
    """A one-line, user-facing error about models or the cache."""


class SpecError(ModelError):
    """A specification refused. `field` names the spec field at fault ('draft.vocab', 'target.device', 'k');
    `fixes` lists (field, value) settings that would be accepted instead (value None: leave the field out),
    so that a front end can name its own options for them. `runtime`: the settings are valid, the machine
    cannot honour them (a model not installed, an architecture a loader does not support)."""

    def __init__(self, message: str, field: str, fixes: tuple[tuple[str, Any], ...] = (),
                 runtime: bool = False) -> None:
        super().__init__(message)
        self.field, self.fixes, self.runtime = field, fixes, runtime


def exception_line(exc: BaseException) -> str:
    """An exception as one line: its type and its message's first line."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
