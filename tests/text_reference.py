"""The text path as it was before it was made incremental: every round decodes all the generated ids (and every
prefix of the round's ids). Quadratic in the output's length, but obviously right: the oracle the incremental text
path (verispec.pipeline.text, verispec.pipeline.provenance) is tested against, and the baseline bench/text_path.py
times it against."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from verispec.pipeline.provenance import DRAFT, TARGET, Piece
from verispec.pipeline.text import REPLACEMENT


class ReferenceAssembler:
    """Accumulates generated ids; `push` returns the newly showable text, `stop_index` is the engine's
    stop callback, `text` is the final text (cut before the stop string)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.shown = 0  # characters already returned by push
        self._decoded: tuple[int, str] = (0, "")
        self.stop_at: int | None = None  # character offset where a stop string begins

    def _decode(self, ids: list[int]) -> str:
        if self._decoded[0] == len(ids) and ids is self.ids:
            return self._decoded[1]
        text = self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        if ids is self.ids:
            self._decoded = (len(ids), text)
        return text

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop that *ends* first in `text` (on equal ends, the one starting
        first). Plain decoding checks after every token, so the first stop to be completed wins there;
        ranking by end gives the same answer however many tokens a round commits at once."""
        hits = [(text.find(s) + len(s), text.find(s), s) for s in self.stop if s in text]
        if not hits:
            return None
        _, start, stop = min(hits)
        return start, stop

    def stop_index(self, generated: list[int]) -> int | None:
        """Engine callback: how many generated tokens to keep when a stop string has appeared."""
        if not self.stop:
            return None
        text = self.tokenizer.decode(generated, skip_special_tokens=True, clean_up_tokenization_spaces=False)
        hit = self._find_stop(text)
        if hit is None:
            return None
        end = hit[0] + len(hit[1])
        keep = len(generated)
        while keep > 1 and len(self.tokenizer.decode(generated[: keep - 1], skip_special_tokens=True,
                                                     clean_up_tokenization_spaces=False)) >= end:
            keep -= 1
        return keep

    def push(self, tokens: list[int]) -> str:
        self.ids.extend(tokens)
        text = self._decode(self.ids)
        hit = self._find_stop(text)
        if hit is not None:
            self.stop_at = hit[0]
            end = hit[0]
        else:
            end = len(text.rstrip(REPLACEMENT)) - self.holdback
        if end <= self.shown:
            return ""
        piece = text[self.shown : end]
        self.shown = end
        return piece

    def finish(self) -> str:
        """The rest of the text once generation ended."""
        text = self.text
        piece = text[self.shown :]
        self.shown = len(text)
        return piece

    @property
    def text(self) -> str:
        text = self._decode(self.ids)
        hit = self._find_stop(text)
        return text[: hit[0]] if hit else text


class ReferenceText:
    """Accumulates committed chunks; `push` returns the Piece newly showable (None: nothing yet), `finish`
    the rest (None: nothing left). `assembler` is the TextAssembler deciding what may be shown (its
    `stop_index` is the engine's stop callback; its `text` the final text)."""

    def __init__(self, tokenizer, stop: Sequence[str] = ()) -> None:
        self.assembler = ReferenceAssembler(tokenizer, stop)
        self._sources: list[str] = []  # per generated token: DRAFT or TARGET
        self._ends: list[int] = []  # per generated token: where its text ends in the decoded text
        self._done = 0  # tokens already handed out in a piece
        self._shown = 0  # characters already handed out

    @property
    def stop_test(self) -> Callable[[list[int]], int | None] | None:
        """The engine's test for the stop strings, on generated ids (None: there are none to test)."""
        return self.assembler.stop_index if self.assembler.stop else None

    def _decode(self, n: int) -> str:
        return self.assembler.tokenizer.decode(self.assembler.ids[:n], skip_special_tokens=True,
                                               clean_up_tokenization_spaces=False)

    def push(self, chunk: Sequence[int], accepted: int | None = None) -> Piece | None:
        """Add one round's tokens (`accepted`: how many were drafted-and-accepted; default: the chunk's own
        `.accepted`, else none)."""
        if accepted is None:
            accepted = getattr(chunk, "accepted", 0)
        start = len(self.assembler.ids)
        self.assembler.push(list(chunk))
        full = self.assembler._decode(self.assembler.ids)
        self._sources += [DRAFT] * accepted + [TARGET] * (len(chunk) - accepted)
        last = self._ends[-1] if self._ends else 0
        for i in range(start + 1, start + len(chunk) + 1):
            text = full if i == len(self.assembler.ids) else self._decode(i)
            end = len(text.rstrip(REPLACEMENT))
            if not full.startswith(text[:end]):  # a decoder whose prefixes are not prefixes of the whole
                end = next((j for j, (a, b) in enumerate(zip(text, full)) if a != b), min(end, len(full)))
            last = max(last, end)
            self._ends.append(last)
        limit = self.assembler.shown
        upto = self._done
        while upto < len(self._ends) and self._ends[upto] <= limit:
            upto += 1
        while upto > self._done and self._ends[upto - 1] == (self._ends[upto - 2] if upto > 1 else 0):
            upto -= 1  # a trailing token that added no text (yet): it comes with the text that follows
        if upto == self._done or self._ends[upto - 1] <= self._shown:
            return None  # no new text: the tokens wait for the piece that shows text
        return self._piece(upto, self._ends[upto - 1], full)

    def finish(self) -> Piece | None:
        """The rest once generation ended: the remaining text (cut before a stop string) and every token not
        handed out yet."""
        self.assembler.finish()
        if self._done == len(self._ends):
            return None
        text = self.assembler.text
        return self._piece(len(self._ends), len(text), text)

    def _piece(self, upto: int, end: int, full: str) -> Piece:
        spans, start = [], self._shown
        for i in range(self._done, upto):
            stop = min(self._ends[i], end) if i < upto - 1 else end
            stop = max(stop, start)
            spans.append((full[start:stop], self._sources[i]))
            start = stop
        accepted = sum(source == DRAFT for _, source in spans)
        piece = Piece(full[self._shown : end], accepted, len(spans) - accepted, tuple(spans))
        self._done, self._shown = upto, end
        return piece

    @property
    def text(self) -> str:
        """The text so far (final once `finish` was called): cut before a stop string."""
        return self.assembler.text


