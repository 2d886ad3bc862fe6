"""Text at the edge: prompts (plain or chat-templated), incremental detokenisation, stop strings.

The engine knows token ids only; this module turns them into text that streams correctly across
multi-byte characters and never shows text past (or the beginning of a possible) stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"  # what a decoder shows for an incomplete multi-byte character


def encode_prompt(tokenizer, prompt: str, chat: bool, system: str | None = None) -> list[int]:
    if not chat:
        return list(tokenizer(prompt).input_ids)
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return encode_messages(tokenizer, messages)


def encode_messages(tokenizer, messages: list[dict]) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model's tokenizer has no chat template: give a plain text prompt")
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return list(tokenizer(text, add_special_tokens=False).input_ids)


class TextAssembler:
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
