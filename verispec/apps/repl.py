"""The `verispec chat` REPL: streaming answers, stats after each, /reset /stats /exit, Ctrl-C, Ctrl-D.

Interactive on a terminal; with piped stdin each input line is one user message and only the answers go
to stdout (stats to stderr). With colour on, `TokenWriter` shows each token's provenance: drafted and
accepted (green, underlined: visible without colour too) or produced by the target (yellow); without it the
text is written as is."""

from __future__ import annotations

import itertools
import os
import signal
import sys
from typing import TextIO

from verispec.apps.chat import ChatBot
from verispec.pipeline.provenance import DRAFT, TARGET, Piece

HELP = (
    "Commands: /reset (new conversation), /stats (totals), /help, /exit. End a line with \\ to continue it on "
    "the next. Ctrl-C stops an answer, Ctrl-D exits."
)
STYLES = {DRAFT: "green underline", TARGET: "yellow"}
LEGEND = "tokens: drafted and accepted = green, underlined; produced by the target = yellow"


class TokenWriter:
    """Writes streamed Pieces to `out`: each run of tokens wrapped in its provenance's ANSI style (rich's
    Style; NO_COLOR set: underline only) when `color`, else the plain text. The text itself is written as is
    (control characters included), so stripping the styles gives back the plain output byte for byte."""

    def __init__(self, out: TextIO, color: bool) -> None:
        self.out, self.styles = out, None
        if color:
            from rich.style import Style

            plain = bool(os.environ.get("NO_COLOR"))
            self.styles = {source: Style.parse("underline" if plain and "underline" in style else
                                               "none" if plain else style) for source, style in STYLES.items()}

    def write(self, piece: Piece) -> None:
        if self.styles is None:
            self.out.write(piece.text)
        else:
            from rich.color import ColorSystem

            for source, group in itertools.groupby(piece.spans, key=lambda span: span[1]):  # fewer escape codes
                text = "".join(text for text, _ in group)
                if text:
                    self.out.write(self.styles[source].render(text, color_system=ColorSystem.STANDARD))
        self.out.flush()

    def text(self, text: str) -> None:
        """Text of no token (a marker, a newline): unstyled."""
        self.out.write(text)
        self.out.flush()


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
    """What runs and why: the target's backend, the drafter, k, the reason for the backend and the llama.cpp
    kernels."""
    s = bot.pipeline.setup()
    kernels = f"; {s['kernels']}" if s["kernels"] else ""
    return f"backend {s['backend']}, drafter {s['drafter']}, k={s['k']} ({s['reason']}{kernels})"


def _answer(bot: ChatBot, message: str, out: TokenWriter, info: TextIO) -> None:
    """Stream one answer. Ctrl-C sets a flag; the answer stops at the next round boundary, so the
    caches stay consistent and the partial reply stays in the history."""
    interrupted = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: interrupted.append(True))
    try:
        stream = bot.stream_pieces(message)
        for piece in stream:
            out.write(piece)
            if interrupted:
                stream.close()
                out.text("\n[stopped]")
                break
    finally:
        signal.signal(signal.SIGINT, previous)
    out.text("\n")
    if bot.last_turn is not None:
        print(f"[{bot.last_turn.line()}]", file=info, flush=True)


def run_repl(bot: ChatBot, interactive: bool, banner: str = "", color: bool = False) -> int:
    """The loop; `color`: show each answer's tokens coloured by provenance."""
    out = TokenWriter(sys.stdout, color)
    info = sys.stdout if interactive else sys.stderr
    if interactive:
        try:
            import readline  # noqa: F401  (line editing and history for input())
        except ImportError:
            pass
        print(banner, file=info)
        print(HELP, file=info, flush=True)
    if color:
        print(f"[{LEGEND}]", file=info, flush=True)
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
