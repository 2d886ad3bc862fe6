"""The `verispec chat` REPL: streaming answers, stats after each, /reset /stats /exit, Ctrl-C, Ctrl-D.

Interactive on a terminal; with piped stdin each input line is one user message and only the answers go
to stdout (stats to stderr)."""

from __future__ import annotations

import signal
import sys
from typing import TextIO

from verispec.chat import ChatBot

HELP = (
    "Commands: /reset (new conversation), /stats (totals), /help, /exit. End a line with \\ to continue it on "
    "the next. Ctrl-C stops an answer, Ctrl-D exits."
)


def _read_message(prompt: str) -> str | None:
    """One user message (lines ending in a backslash continue). None at end of input."""
    lines = []
    while True:
        try:
            line = input(prompt if not lines else "... ")
        except EOFError:
            return None if not lines else "\n".join(lines)
        if line.endswith("\\"):
            lines.append(line[:-1])
            continue
        lines.append(line)
        return "\n".join(lines)


def _totals(bot: ChatBot) -> str:
    s = bot.total_stats()
    line = f"{len(bot.turns)} turns, {s.new_tokens} tokens, {s.tokens_per_second:.1f} tok/s"
    if s.drafted:
        line += (f", acceptance {s.acceptance_rate:.1%} ({s.accepted}/{s.drafted}), "
                 f"mean accepted length {s.mean_accepted_length:.2f}")
    speedups = [t.speedup for t in bot.turns if t.speedup is not None]
    if speedups:
        line += f", mean speedup {sum(speedups) / len(speedups):.2f}x vs plain"
    return line


def _setup(bot: ChatBot) -> str:
    """What runs and why: the target's backend, the drafter, k, and the reason for the backend."""
    s = bot.pipeline.setup()
    return f"backend {s['backend']}, drafter {s['drafter']}, k={s['k']} ({s['reason']})"


def _answer(bot: ChatBot, message: str, out: TextIO, info: TextIO) -> None:
    """Stream one answer. Ctrl-C sets a flag; the answer stops at the next round boundary, so the
    caches stay consistent and the partial reply stays in the history."""
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(True))
    try:
        stream = bot.stream_response(message)
        for piece in stream:
            out.write(piece)
            out.flush()
            if interrupted:
                stream.close()
                out.write("\n[stopped]")
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    out.write("\n")
    out.flush()
    if bot.last_turn is not None:
        print(f"[{bot.last_turn.line()}]", file=info, flush=True)


def run_repl(bot: ChatBot, interactive: bool, banner: str = "") -> int:
    out = sys.stdout
    info = sys.stdout if interactive else sys.stderr
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(banner, file=info)
        print(HELP, file=info, flush=True)
    while True:
        try:
            message = _read_message(">>> " if interactive else "")
        except KeyboardInterrupt:  # Ctrl-C at the prompt: drop the line, stay
            print(file=info)
            continue
        if message is None:
            if interactive:
                print(file=info)
            return 0
        command = message.strip()
        if not command:
            continue
        if command in ("/exit", "/quit"):
            return 0
        if command == "/reset":
            bot.reset()
            print("[conversation reset]", file=info, flush=True)
            continue
        if command == "/stats":
            print(f"[{_totals(bot)}]", file=info)
            print(f"[{_setup(bot)}]", file=info, flush=True)
            continue
        if command == "/help":
            print(HELP, file=info, flush=True)
            continue
        _answer(bot, message, out, info)
