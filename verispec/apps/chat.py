"""ChatBot: multi-turn conversation on the speculative engine, with streaming and acceptance statistics.

Each turn renders the whole history with the tokenizer's chat template. The engine keeps both KV caches
and reuses the longest common token prefix with what they already hold, so earlier turns are not
re-encoded; when the template renders earlier turns differently (e.g. the generated tokens were not the
canonical tokenisation of the reply), only the part that really differs is recomputed.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

from verispec.core.sampling import SamplingParams
from verispec.decoding.request import Request
from verispec.decoding.stats import SpecStats
from verispec.names.options import MAX_NEW_TOKENS
from verispec.pipeline.pipeline import Pipeline
from verispec.pipeline.provenance import Piece
from verispec.pipeline.text import encode_messages


@dataclass
class TurnStats:
    """One turn's statistics: the engine's SpecStats, the reply's length, whether it was interrupted, and
    plain decoding of the same prompt when it was measured (for the speedup)."""

    stats: SpecStats
    reply_tokens: int
    interrupted: bool = False
    plain_seconds: float | None = None  # plain decoding of the same prompt, when measured
    plain_tokens: int = 0

    @property
    def speedup(self) -> float | None:
        """Tokens per second of this turn over plain decoding's, measured in the same process."""
        if self.plain_seconds is None or not self.plain_tokens or self.stats.tokens_per_second <= 0:
            return None
        return self.stats.tokens_per_second / (self.plain_tokens / self.plain_seconds)

    def line(self) -> str:
        """The statistics as one line for people."""
        s = self.stats
        parts = [f"{s.new_tokens} tokens", f"{s.tokens_per_second:.1f} tok/s"]
        if s.drafted:
            parts += [f"acceptance {s.acceptance_rate:.1%}", f"mean accepted length {s.mean_accepted_length:.2f}"]
        if self.speedup is not None:
            parts.append(f"speedup {self.speedup:.2f}x vs plain ({self.plain_seconds:.2f}s)")
        if self.interrupted:
            parts.append("interrupted")
        return " | ".join(parts)


@dataclass
class ChatBot:
    """A conversation over a pipeline: `generate_response(message)` or `stream_response(message)` for each
    user turn; the history (and the system prompt, if any) is rendered with the chat template every turn.
    `params`, `k` (None: the pipeline's), `max_new_tokens` and `stop` apply to every turn;
    `measure_plain` also times plain decoding of each reply, for the speedup."""

    pipeline: Pipeline
    system_prompt: str | None = None
    params: SamplingParams = SamplingParams()
    k: int | None = None
    max_new_tokens: int = MAX_NEW_TOKENS
    stop: tuple[str, ...] = ()
    measure_plain: bool = False
    history: list[dict] = field(default_factory=list)
    turns: list[TurnStats] = field(default_factory=list)

    # -- conversation ----------------------------------------------------------------------------

    def messages(self, user_message: str | None = None) -> list[dict]:
        """The conversation as chat messages: system prompt, history, and `user_message` when given."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        user = [{"role": "user", "content": user_message}] if user_message is not None else []
        return system + self.history + user

    def prompt_ids(self, user_message: str) -> list[int]:
        """The token ids the next turn's prompt has when the user says `user_message`."""
        return encode_messages(self.pipeline.tokenizer, self.messages(user_message))

    def stream_response(self, user_message: str) -> Iterator[str]:
        """Yields text pieces as they are accepted. Closing the iterator early (Ctrl-C) keeps the partial
        reply in the history and the caches consistent."""
        pieces = self.stream_pieces(user_message)
        try:
            for piece in pieces:
                if piece.text:
                    yield piece.text
        finally:
            pieces.close()

    def stream_pieces(self, user_message: str) -> Iterator[Piece]:
        """As stream_response, as Pieces: each also says which of its tokens were drafted-and-accepted and
        which the target produced (verispec.pipeline.provenance); the last may have no text."""
        if not user_message.strip():
            raise ValueError("empty message")
        prompt = self.prompt_ids(user_message)
        stream = self.pipeline.stream(Request(prompt_ids=prompt, params=self.params,
                                              max_new_tokens=self.max_new_tokens,
                                              k=self.k, stop=self.stop))
        try:
            yield from stream.pieces()
        finally:
            stream.close()
            result = stream.result
            self.history += [{"role": "user", "content": user_message}, {"role": "assistant", "content": result.text}]
            turn = TurnStats(result.stats, len(result.token_ids), interrupted=not stream.finished)
            if stream.finished and self.measure_plain and turn.reply_tokens:
                turn.plain_seconds, turn.plain_tokens = self._plain_decode(prompt, turn.reply_tokens)
            self.turns.append(turn)

    def generate_response(self, user_message: str) -> str:
        """The whole reply to `user_message` (the turn is added to the history)."""
        return "".join(self.stream_response(user_message))

    def reset(self) -> None:
        """Forget the conversation and its statistics (the caches are reused by prefix as ever)."""
        self.history.clear()
        self.turns.clear()

    # -- statistics ------------------------------------------------------------------------------

    @property
    def last_turn(self) -> TurnStats | None:
        """The last turn's statistics (None before the first turn)."""
        return self.turns[-1] if self.turns else None

    def total_stats(self) -> SpecStats:
        """The statistics of every turn, merged."""
        total = SpecStats()
        for turn in self.turns:
            total.merge(turn.stats)
        return total

    def _plain_decode(self, prompt: list[int], n_tokens: int) -> tuple[float, int]:
        """Plain target decoding of the same prompt, at most as many tokens: (seconds, tokens)."""
        t0 = time.perf_counter()
        result = self.pipeline.engine.generate(prompt, self.params, max_new_tokens=n_tokens, k=0)
        return time.perf_counter() - t0, len(result.token_ids)
