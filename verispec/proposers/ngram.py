"""Prompt lookup / n-gram drafting: propose the continuation of the most recent earlier occurrence of the
sequence's last n tokens (n from max_ngram down to min_ngram). Zero model cost; strong when the output
copies from the context (code editing, summarisation, RAG).

Drafts are deterministic, so the verifier treats q as one-hot on them (`probs=None`): exact for sampling
too. A round may propose fewer than k tokens, or none (no match): the engine then decodes plainly.
"""

from __future__ import annotations

import torch

from verispec.core.draft import Draft
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.names.drafters import Source


def find_match(tokens: list[int], max_ngram: int, min_ngram: int) -> tuple[int, int]:
    """(index of the continuation after the latest earlier match of the longest matching suffix, its n);
    (0, 0) when no suffix of min_ngram..max_ngram tokens occurred before with a token after it."""
    L = len(tokens)
    for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
        suffix = tokens[L - n :]
        first = suffix[0]
        # latest start i < L - n with tokens[i:i+n] == suffix and at least one token after the match
        for i in range(L - n - 1, -1, -1):
            if tokens[i] == first and tokens[i : i + n] == suffix:
                return i + n, n
    return 0, 0


def find_continuation(tokens: list[int], k: int, max_ngram: int, min_ngram: int) -> tuple[list[int], int]:
    """(up to k tokens that followed the latest earlier match of the longest matching suffix, its n)."""
    at, n = find_match(tokens, max_ngram, min_ngram)
    return (tokens[at : at + k], n) if n else ([], 0)


def lookup_guess(tokens: list[int], max_ngram: int = 4) -> int:
    """One free guess at the next token: what followed the latest earlier occurrence of the longest matching
    suffix (down to one token), else the last token again."""
    at, n = find_match(tokens, max_ngram, 1)
    return tokens[at] if n else tokens[-1]


class NgramProposer:
    """Prompt lookup. It names each round's draft source by the match it has (`source`): long matches
    (>= min_confident tokens) are accepted far more often than short ones, so a k policy that learns per
    source keeps drafting the long ones through a spell of failing short ones."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, min_confident: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.min_confident = max_ngram, min_ngram, min_confident
        self.last_match = 0  # n of the last match (0: none)
        self._match: tuple[TokenSequence, int, int, int] | None = None  # (seq, len(seq), at, n) of this round

    def start(self, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        self.last_match = 0
        self._match = None

    def match(self, seq: TokenSequence) -> tuple[int, int]:
        """find_match on this round's sequence, looked up once per round (source and propose both ask): within a generation the sequence only grows, so the object and its length name the round."""
        if self._match is None or self._match[0] is not seq or self._match[1] != len(seq):
            self._match = (seq, len(seq), *find_match(seq.ids, self.max_ngram, self.min_ngram))
        return self._match[2], self._match[3]

    def source(self, seq: TokenSequence) -> str:
        """'ngram' (a match of at least min_confident tokens), 'ngram-short' (a shorter one) or 'none'."""
        n = self.match(seq)[1]
        return Source.NONE if not n else Source.NGRAM if n >= self.min_confident else Source.NGRAM_SHORT

    def propose(self, seq: TokenSequence, k: int) -> Draft:
        source = self.source(seq)
        at, self.last_match = self.match(seq)
        tokens = seq.ids[at : at + k] if self.last_match else []
        device = seq.buffer.device
        return Draft(device_tensor(tokens, device), None, source)

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        pass

    def end(self) -> None:
        self._match = None

    def reset(self) -> None:
        self.last_match = 0
        self._match = None
