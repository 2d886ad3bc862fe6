"""What a generation gives back as text: `Completion`."""

from __future__ import annotations

from dataclasses import dataclass, field

from verispec.core.rows import TokenLogprob
from verispec.decoding.request import GenerationResult
from verispec.decoding.stats import SpecStats


@dataclass
class Completion:
    """One generation's outcome: the text (cut before a stop string; special tokens skipped), the generated
    token ids (an EOS that ended generation included), why it ended ("stop": EOS or a stop string;
    "length": max_new_tokens or the context), its speculation statistics and, where asked for, each token's
    logprob and its most likely alternatives."""

    text: str
    token_ids: list[int]
    finish_reason: str
    stats: SpecStats = field(default_factory=SpecStats)
    logprobs: list[TokenLogprob] | None = None

    @classmethod
    def of(cls, text: str, result: GenerationResult) -> Completion:
        """The Completion of a generation's token-level result and its text."""
        logprobs = None if result.logprobs is None else list(result.logprobs)
        return cls(text, list(result.token_ids), result.finish_reason, result.stats, logprobs)
