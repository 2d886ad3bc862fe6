"""Text at the edge: prompts (plain or chat-templated), incremental detokenisation, stop strings.

The engine knows token ids only; this module turns them into text that streams correctly across
multi-byte characters and never shows text past (or the beginning of a possible) stop string.
"""

from __future__ import annotations

import bisect
import json
import re
import time
import weakref
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete multi-byte character
INDENT, NEWLINE = "indent", "newline"  # TextAssembler.stopped_by for its line rules (else the stop string)
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


def encode_prompt(tokenizer, prompt: str, chat: bool, system: str | None = None) -> list[int]:
    if not chat:
        return list(tokenizer(prompt).input_ids)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The ids of chat messages through the tokenizer's chat template, the assistant's turn opened; `tools`: the
    functions the assistant may call (OpenAI's {"type": "function", "function": {...}}), which the template renders."""
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: give a plain text prompt")
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


def prompt_strings(prompt: str | Iterable[Any]) -> list[str]:
    """The text of a prompt (plain text, or chat messages: each one's string content and text parts; token ids
    give none)."""
    if isinstance(prompt, str):
        return [prompt]
    out = []
    for message in prompt:
        content = message.get("content") if isinstance(message, Mapping) else None
        if isinstance(content, str):
            out.append(content)
        elif isinstance(content, list):
            out += [p["text"] for p in content if isinstance(p, Mapping) and isinstance(p.get("text"), str)]
    return out


def json_string_texts(tokenizer, strings: Iterable[str]) -> tuple[tuple[int, ...], ...]:
    """Each string as an answer in JSON writes it inside a string value (json.dumps's escapes: a newline as \\n, a
    quote as \\", non-ASCII as it is), tokenised: the lookup texts of a request whose answer is JSON (a schema's
    strings, a tool call's arguments), where the prompt's own text, code above all, does not match what the answer
    copies of it. Strings that need no escape are left out (the prompt holds them as they are)."""
    out = []
    for text in strings:
        escaped = json.dumps(text, ensure_ascii=False)[1:-1]
        if escaped != text:
            out.append(tuple(tokenizer(escaped, add_special_tokens=False).input_ids))
    return tuple(out)


_BYTE_TOKENS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> its byte-fallback ids


def byte_tokens(tokenizer) -> frozenset[int]:
    """The ids of a tokenizer's byte-fallback tokens (`<0xNN>`, SentencePiece's spelling of a raw byte), found once
    per tokenizer. A SentencePiece decoder turns a run of them into text only when the whole run is valid UTF-8 (one
    U+FFFD per byte otherwise), so a run's text is not known before a token of another kind ends it (a special token
    does not: a decode that skips special tokens drops it before the decoder joins the run)."""
    try:
        return _BYTE_TOKENS[tokenizer]
    except (KeyError, TypeError):
        pass
    found = frozenset(i for piece, i in tokenizer.get_vocab().items() if _BYTE_PIECE.fullmatch(piece))
    try:
        _BYTE_TOKENS[tokenizer] = found
    except TypeError:  # a tokenizer that takes no weak reference: found again next time
        pass
    return found


class TextAssembler:
    """Generated ids -> text, in time linear in their number: `push` returns the newly showable text, `stop_index`
    is the engine's stop test, `text` the final text (cut before the stop string).

    Each id is decoded with the few ids before it, as vLLM's incremental detokenizer and transformers' TextStreamer
    do: the window starts where the last complete text began, and the text an id adds is what the window decodes to
    past what the window's first part decodes to. The first part absorbs a tokenizer's context (SentencePiece drops
    the leading space at the start of a decode, so a prefix's decode need not be a prefix of the whole's); text
    ending in an incomplete character (U+FFFD: the first bytes of a character split over ids), or in a run of
    byte-fallback tokens (whose text a later byte can still turn into U+FFFDs, see byte_tokens), stays in the window
    (`tail`) until a later id completes it. So `text` equals one decode of all the ids, and an id costs a decode of a
    few ids whatever came before.

    Stop strings are searched in the text new since the last search and a tail as long as the longest stop before
    it; of those found, the one that ends first wins (see _find_stop). `stop_index` maps the stop's end to the ids to
    keep from the per-id text lengths, without decoding again. The stop test may read ids before they are pushed
    (the engine tests a round's ids before the text shows them); `push` then does not read them again.

    Two line rules, for code completion (llama-server's n_indent and t_max_predict_ms), end the text like a stop:
    `min_indent` > 0: a line after the first whose first character other than a space or tab (a blank line's
    newline included) comes at a smaller indent ends the text before that character; `newline_after` seconds: once
    that long has passed since the first id was read, the next newline ends the text after it (a round's text
    counts as read when its round is tested). `stopped_by` says what ended the text: the stop string, INDENT or
    NEWLINE (None: nothing).
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), min_indent: int = 0, newline_after: float | None = None,
                 clock=time.monotonic) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_indent, self.newline_after, self._clock = min_indent, newline_after, clock
        self.stopped_by: str | None = None
        self._first_read: float | None = None  # when the first id was read (newline_after counts from then)
        self._indent_from = 0  # the line rules look for newlines from here on
        self._newline_from = 0
        self.longest = max((len(s) for s in self.stop), default=1)
        self.holdback = self.longest - 1
        self.ids: list[int] = []  # the ids pushed
        self.read: list[int] = []  # the ids decoded: the pushed ones, and those a stop test saw beyond them
        self.lengths: list[int] = []  # per id read: the length of the decode of the ids through it
        self.ends: list[int] = []  # per id read: the characters of that text that can be shown (complete ones)
        self.shown = 0  # characters already returned by push
        self.stop_at: int | None = None  # character offset where a stop string begins
        self._parts: list[str] = []  # the complete text, as the ids added it
        self._starts: list[int] = []  # where each part begins
        self._length = 0  # characters of complete text
        self._tail = ""  # text of the window past its first part that is not complete yet (ends in U+FFFD)
        self._prefix = self._split = 0  # the window: read[_prefix:]; its first part: read[_prefix:_split]
        self._prefix_text = ""
        self._bytes = byte_tokens(tokenizer)
        self._special = frozenset(getattr(tokenizer, "all_special_ids", ()))
        self._in_run = False  # the last id read that is not special is a byte token
        self._searched = 0  # complete characters searched for stops
        self._stop_keep: int | None = None  # ids to keep, once a stop string was found

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)

    @property
    def has_stops(self) -> bool:
        """Whether anything but the ids' end can end the text (stop strings or a line rule)."""
        return bool(self.stop) or self.min_indent > 0 or self.newline_after is not None

    def _read(self, token: int) -> None:
        """Decode one more id: its window, and the text it completes."""
        if self._first_read is None:
            self._first_read = self._clock()
        self.read.append(token)
        window = self._decode(self.read[self._prefix :])
        in_run = self._in_run = token in self._bytes or (token in self._special and self._in_run)
        if not window.endswith(REPLACEMENT) and not in_run:
            new = window[len(self._prefix_text) :]
            if new:
                self._parts.append(new)
                self._starts.append(self._length)
                self._length += len(new)
            self._prefix, self._split = self._split, len(self.read)
            self._prefix_text = self._decode(self.read[self._prefix : self._split])
            self._tail = ""
        else:
            self._tail = window[len(self._prefix_text) :]
        self.lengths.append(self._length + len(self._tail))
        shown = self._length + (0 if in_run else len(self._tail.rstrip(REPLACEMENT)))  # a run's text is not final
        self.ends.append(max(shown, self.ends[-1] if self.ends else 0))

    def _slice(self, start: int, end: int) -> str:
        """The text between two character offsets (the tail included), from the parts that hold it."""
        out, i = [], max(0, bisect.bisect_right(self._starts, start) - 1)
        while i < len(self._parts) and self._starts[i] < end:
            part, at = self._parts[i], self._starts[i]
            out.append(part[max(0, start - at) : end - at])
            i += 1
        if end > self._length:
            out.append(self._tail[max(0, start - self._length) : end - self._length])
        return "".join(out)

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the stop that *ends* first in `text` (on equal ends, the one starting
        first). Plain decoding checks after every token, so the first stop to be completed wins there;
        ranking by end gives the same answer however many tokens a round commits at once."""
        hits = [(text.find(s) + len(s), text.find(s), s) for s in self.stop if s in text]
        if not hits:
            return None
        _, start, stop = min(hits)
        return start, stop

    def _line_hits(self, known: int) -> list[tuple[int, int, str]]:
        """The line rules' stops in the text up to `known` characters: (where each is decided, where it cuts, the
        rule)."""
        hits = []
        if self.newline_after is not None and self._first_read is not None:
            start, self._newline_from = self._newline_from, self._length
            if self._clock() - self._first_read >= self.newline_after:
                at = self._slice(start, known).find("\n")
                if at >= 0:
                    hits.append((start + at + 1, start + at + 1, NEWLINE))
        if self.min_indent > 0:
            start = self._indent_from
            text, at = self._slice(start, known), 0
            self._indent_from = self._length
            while (at := text.find("\n", at)) >= 0:
                first = at + 1
                while first < len(text) and text[first] in " \t":
                    first += 1
                if first == len(text):  # its indent is not known yet: look at this line again next time
                    self._indent_from = min(self._indent_from, start + at)
                    break
                if first - at - 1 < self.min_indent:
                    hits.append((start + first + 1, start + first, INDENT))
                    break
                at = first
        return hits

    def _search(self) -> None:
        """Look for a stop string in the text not searched yet (and the longest stop's length before it), and for
        the line rules' stops."""
        if not self.has_stops or self._stop_keep is not None:
            return
        known = self._length + len(self._tail)
        hits = self._line_hits(known)
        if self.stop:
            start = max(0, self._searched - (self.longest - 1))
            hit = self._find_stop(self._slice(start, known))
            if hit is not None:
                hits.append((start + hit[0] + len(hit[1]), start + hit[0], hit[1]))
        self._searched = self._length
        if not hits:
            return
        end, self.stop_at, self.stopped_by = min(hits)
        keep = len(self.read)
        while keep > 1 and self.lengths[keep - 2] >= end:
            keep -= 1
        self._stop_keep = keep

    def _ingest(self, ids: list[int], at: int) -> None:
        """ids that follow the first `at` ids read: read those not read yet (ids that differ from what was read
        rewind the reading to them)."""
        for j, token in enumerate(ids):
            i = at + j
            if i < len(self.read) and self.read[i] == token:
                continue
            if i < len(self.read):
                self._rewind(i)
            self._read(token)

    def _rewind(self, n: int) -> None:
        """Forget every id read from the n-th on (read again from the start: a stop test is never shown fewer ids
        than it saw, so this is not a path the engine takes)."""
        kept = self.read[:n]
        state = TextAssembler(self.tokenizer, self.stop, self.min_indent, self.newline_after, self._clock)
        for token in kept:
            state._read(token)
        for name in ("read", "lengths", "ends", "_parts", "_starts", "_length", "_tail", "_prefix", "_split",
                     "_prefix_text", "_in_run"):
            setattr(self, name, getattr(state, name))
        self._searched, self._stop_keep, self.stop_at, self.stopped_by = 0, None, None, None
        self._indent_from = self._newline_from = 0

    def stop_index(self, generated: list[int]) -> int | None:
        """Engine callback: how many generated tokens to keep when a stop string has appeared (the ids only grow
        between calls)."""
        if not self.has_stops:
            return None
        if len(generated) < len(self.read):
            self._rewind(len(generated))
        self._ingest(generated[len(self.read) :], len(self.read))
        self._search()
        return self._stop_keep

    def push(self, tokens: list[int]) -> str:
        """Add a round's ids; the text they make showable (none past or at the start of a possible stop string)."""
        self._ingest(tokens, len(self.ids))
        self.ids.extend(tokens)
        self._search()
        if self.stop_at is not None:
            end = self.stop_at
        else:
            end = (self.ends[len(self.ids) - 1] if self.ids else 0) - self.holdback
        if end <= self.shown:
            return ""
        piece = self._slice(self.shown, end)
        self.shown = end
        return piece

    def finish(self) -> str:
        """The rest of the text once generation ended."""
        end = self._text_end()
        piece = self._slice(self.shown, end)
        self.shown = end
        return piece

    def span(self, start: int, end: int) -> str:
        """The text between two character offsets."""
        return self._slice(start, end)

    def _text_end(self) -> int:
        if self.stop_at is not None:
            return self.stop_at
        n = len(self.ids)
        return self.lengths[n - 1] if n else 0

    @property
    def text(self) -> str:
        """The text of the ids pushed (cut before a stop string)."""
        return self._slice(0, self._text_end())
