"""Which text the target wrote itself and which it accepted from the draft, as the text streams.

The engine commits each round's tokens as a `Committed` chunk: the first `accepted` were drafted and accepted,
the rest the target produced (a recovered or bonus token). `ProvenanceText` turns those chunks into `Piece`s:
the newly showable text, how many of the tokens it carries were drafted-and-accepted and how many the target
produced, and the text split per token (`spans`, one per token, in order).

A piece ends on a token boundary, so every token lies in exactly one piece. Text the TextAssembler holds back
(an incomplete UTF-8 character, the possible beginning of a stop string) holds back its tokens too; they come
with the piece that shows their text. Tokens whose text is empty (special tokens; the leading bytes of a
character that spans tokens, whose text the token completing it carries) or cut (those that complete a stop
string) have a span with empty or shortened text and come with the next piece, or the last one, which may
have no text. Over a stream the counts add up to the generated token count and the accepted count.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from verispec.decoding.request import Request
from verispec.pipeline.text import TextAssembler

DRAFT, TARGET = "draft", "target"  # a token drafted and accepted; a token the target produced


@dataclass(frozen=True)
class Piece:
    """Newly showable text and its tokens' provenance: `spans` holds (text, DRAFT | TARGET) per token."""

    text: str
    accepted: int
    target: int
    spans: tuple[tuple[str, str], ...] = ()

    @property
    def tokens(self) -> int:
        return self.accepted + self.target


class ProvenanceText:
    """Accumulates committed chunks; `push` returns the Piece newly showable (None: nothing yet), `finish`
    the rest (None: nothing left). `assembler` is the TextAssembler deciding what may be shown (its
    `stop_index` is the engine's stop callback; its `text` the final text); each token's text is where the
    assembler's text stood once it had read the token (`assembler.ends`), so a round costs what its tokens cost."""

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_indent: int = 0,
                 newline_after: float | None = None) -> None:
        self.assembler = TextAssembler(tokenizer, stop, min_indent, newline_after)
        self._sources: list[str] = []  # per generated token: DRAFT or TARGET
        self._done = 0  # tokens already handed out in a piece
        self._shown = 0  # characters already handed out

    @classmethod
    def of(cls, tokenizer, request: Request) -> ProvenanceText:
        """The text of a request's generation, with its stop strings and line rules."""
        return cls(tokenizer, request.stop, request.min_indent, request.newline_after)

    @property
    def stop_test(self) -> Callable[[list[int]], int | None] | None:
        """The engine's test for the stop strings and line rules, on generated ids (None: there are none)."""
        return self.assembler.stop_index if self.assembler.has_stops else None

    def push(self, chunk: Sequence[int], accepted: int | None = None) -> Piece | None:
        """Add one round's tokens (`accepted`: how many were drafted-and-accepted; default: the chunk's own
        `.accepted`, else none)."""
        if accepted is None:
            accepted = getattr(chunk, "accepted", 0)
        self.assembler.push(list(chunk))
        self._sources += [DRAFT] * accepted + [TARGET] * (len(chunk) - accepted)
        ends, limit, upto = self.assembler.ends, self.assembler.shown, self._done
        while upto < len(self._sources) and ends[upto] <= limit:
            upto += 1
        while upto > self._done and ends[upto - 1] == (ends[upto - 2] if upto > 1 else 0):
            upto -= 1  # a trailing token that added no text (yet): it comes with the text that follows
        if upto == self._done or ends[upto - 1] <= self._shown:
            return None  # no new text: the tokens wait for the piece that shows text
        return self._piece(upto, ends[upto - 1])

    def finish(self) -> Piece | None:
        """The rest once generation ended: the remaining text (cut before a stop string) and every token not
        handed out yet."""
        self.assembler.finish()
        if self._done == len(self._sources):
            return None
        return self._piece(len(self._sources), self.assembler.shown)

    def _piece(self, upto: int, end: int) -> Piece:
        spans, start, ends = [], self._shown, self.assembler.ends
        for i in range(self._done, upto):
            stop = min(ends[i], end) if i < upto - 1 else end
            stop = max(stop, start)
            spans.append((self.assembler.span(start, stop), self._sources[i]))
            start = stop
        accepted = sum(source == DRAFT for _, source in spans)
        piece = Piece(self.assembler.span(self._shown, end), accepted, len(spans) - accepted, tuple(spans))
        self._done, self._shown = upto, end
        return piece

    @property
    def text(self) -> str:
        """The text so far (final once `finish` was called): cut before a stop string."""
        return self.assembler.text

    @property
    def stop_reason(self) -> str | None:
        """The stop string or line rule that ended the text (None: none has)."""
        return self.assembler.stopped_by


__all__ = ["DRAFT", "TARGET", "Piece", "ProvenanceText"]
