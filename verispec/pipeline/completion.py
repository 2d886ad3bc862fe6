"""What a generation gives back as text: `Completion`."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.core.rows import TokenLogprob
from verispec.decoding.request import GenerationResult
from verispec.decoding.stats import SpecStats


@dataclass
class Completion:
    """One generation's outcome: the text (cut before a stop string; special tokens skipped), the generated
    token ids (an EOS that ended generation included), why it ended ("stop": EOS, a stop string or a line rule;
    "length": max_new_tokens or the context), its speculation statistics and, where asked for, each token's
    logprob and its most likely alternatives. `stop_reason` (vLLM's name): the stop string, or the line rule
    (verispec.pipeline.text's INDENT, NEWLINE), that ended the text (None: none did)."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | None = None

    @classmethod
    def of(cls, text: str, result: GenerationResult, stop_reason: str | None = None) -> Completion:
        """The Completion of a generation's token-level result and its text."""
        logprobs = None if result.logprobs is None else list(result.logprobs)
        return cls(text, list(result.token_ids), result.finish_reason, result.stats, logprobs, stop_reason)
