"""Prompt lookup / n-gram drafting: propose the continuation of the sequence's last n tokens (n from max_ngram down
to min_ngram) where they occurred before: their most recent earlier occurrence in the sequence, or their first in
the other texts its request gives to copy from (Request.lookup_texts: the prompt's strings as a JSON answer escapes
them). Zero model cost; strong when the output copies from the context (code editing, summarisation, RAG).

Drafts are deterministic, so the verifier treats q as one-hot on them (`probs=None`): exact for sampling
too. A round may propose fewer than k tokens, or none (no match): the engine then decodes plainly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.core.draft import Draft
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.names.drafters import Source


class NgramIndex:
    """Where each n-gram (n = 1..max_ngram) of a growing token list last started with a token after it. It is
    brought up to date with the tokens appended since the last lookup, so over a generation a match costs
    O(max_ngram) per round however long the sequence, not a scan of it."""

    def __init__(self, max_ngram: int) -> None:
        self.max_ngram = max_ngram
        self._ids: list[int] | None = None  # the list indexed (a reference: appended to between lookups)
        self._seen = 0  # how many of its tokens are indexed
        self._latest: list[dict[tuple[int, ...], int]] = []  # [n][n-gram] -> its latest start

    def match(self, ids: list[int], min_ngram: int) -> tuple[int, int]:
        """(index of the continuation after the latest earlier occurrence of the longest suffix of `ids` of
        min_ngram..max_ngram tokens, its n); (0, 0) when no such suffix occurred before with a token after it.
        `ids` is indexed anew unless it is the list of the last lookup, grown since."""
        if ids is not self._ids or len(ids) < self._seen:
            self._ids, self._seen = ids, 0
            self._latest = [{} for _ in range(self.max_ngram + 1)]
        length = len(ids)
        for n in range(1, self.max_ngram + 1):  # the starts whose n-gram has had a token after it since last time
            lo, hi = max(self._seen - n, 0), length - n
            if lo < hi:  # later starts overwrite earlier ones
                self._latest[n].update(zip(zip(*(ids[lo + j : hi + j] for j in range(n))), range(lo, hi)))
        self._seen = length
        for n in range(min(self.max_ngram, length - 1), min_ngram - 1, -1):
            start = self._latest[n].get(tuple(ids[length - n :]))
            if start is not None:
                return start + n, n
        return 0, 0

    def guess(self, ids: list[int]) -> int:
        """One free guess at the token after `ids`: what followed the latest earlier occurrence of its longest
        matching suffix (down to one token), else its last token again."""
        at, n = self.match(ids, 1)
        return ids[at] if n else ids[-1]


class TextsIndex:
    """Where each n-gram (n = min_ngram..max_ngram) of a generation's fixed texts first starts with a token after
    it."""

    def __init__(self, texts: Sequence[Sequence[int]], min_ngram: int, max_ngram: int) -> None:
        self.texts = [list(t) for t in texts if len(t) > 1]
        self._first: list[dict[tuple[int, ...], tuple[int, int]]] = [{} for _ in range(max_ngram + 1)]
        for t, ids in enumerate(self.texts):
            for n in range(min_ngram, max_ngram + 1):
                for start in range(len(ids) - n):
                    self._first[n].setdefault(tuple(ids[start : start + n]), (t, start + n))

    def match(self, ids: list[int], n: int) -> tuple[int, int] | None:
        """(text, index of the continuation) after the last n tokens of `ids`, or None."""
        return self._first[n].get(tuple(ids[len(ids) - n :])) if len(ids) >= n else None


class NgramProposer:
    """Prompt lookup. It names each round's draft source by the match it has (`source`): long matches
    (>= min_confident tokens) are accepted far more often than short ones, so a k policy that learns per
    source keeps drafting the long ones through a spell of failing short ones."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 2, min_confident: int = 3) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError(f"need 1 <= min_ngram <= max_ngram, got {min_ngram}, {max_ngram}")
        self.max_ngram, self.min_ngram, self.min_confident = max_ngram, min_ngram, min_confident
        self.last_match = 0  # n of the last match (0: none)
        self._index = NgramIndex(max_ngram)
        self._texts = TextsIndex((), min_ngram, max_ngram)

    def start(self, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              texts: Sequence[Sequence[int]] = ()) -> None:
        """A new generation, whose `texts` are searched besides the sequence."""
        self.last_match = 0
        self._texts = TextsIndex(texts, self.min_ngram, self.max_ngram)

    def match(self, seq: TokenSequence) -> tuple[list[int], int, int]:
        """(the tokens this round's match continues in, where its continuation starts, its n): the longest match,
        the sequence's on a tie; ([], 0, 0): no match."""
        at, n = self._index.match(seq.ids, self.min_ngram)
        for longer in range(min(self.max_ngram, len(seq.ids)), max(n, self.min_ngram - 1), -1):
            found = self._texts.match(seq.ids, longer)
            if found is not None:
                return self._texts.texts[found[0]], found[1], longer
        return (seq.ids, at, n) if n else ([], 0, 0)

    def source(self, seq: TokenSequence) -> str:
        """'ngram' (a match of at least min_confident tokens), 'ngram-short' (a shorter one) or 'none'."""
        return self._source_of(self.match(seq)[2])

    def _source_of(self, n: int) -> str:
        return Source.NONE if not n else Source.NGRAM if n >= self.min_confident else Source.NGRAM_SHORT

    def propose(self, seq: TokenSequence, k: int) -> Draft:
        ids, at, self.last_match = self.match(seq)  # one lookup gives the draft and its source
        tokens = ids[at : at + k]
        return Draft(device_tensor(tokens, seq.buffer.device), None, self._source_of(self.last_match))

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        pass

    def end(self) -> None:
        self._index = NgramIndex(self.max_ngram)  # lets the finished sequence go
        self._texts = TextsIndex((), self.min_ngram, self.max_ngram)

    def reset(self) -> None:
        self.last_match = 0
        self.end()
