"""Hybrid drafting: n-gram lookup when it has a confident match, the draft model otherwise."""

from __future__ import annotations

import torch

from verispec.proposers.base import Draft
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.ngram import NgramProposer
from verispec.sampling import SamplingParams
from verispec.sequence import TokenSequence


class HybridProposer:
    """n-gram lookup when it has a confident match (the n-gram proposer's long kind: a suffix of at least its
    `min_confident` tokens), the draft model otherwise. Sources: 'ngram' and 'model', so that a k policy can
    switch the draft model off while free n-gram drafts keep going. The draft model catches up on the tokens
    it skipped the next time it drafts."""

    def __init__(self, ngram: NgramProposer, model: DraftModelProposer) -> None:
        self.ngram, self.model = ngram, model
        self._last: NgramProposer | DraftModelProposer | None = None

    def source(self, seq: TokenSequence) -> str:
        return "ngram" if self.ngram.source(seq) == "ngram" else "model"

    def pending(self, seq: TokenSequence) -> int:
        return self.model.pending(seq) if self.source(seq) == "model" else 0

    def catch_up(self, seq: TokenSequence, limit: int | None = None) -> int:
        return self.model.catch_up(seq, limit) if self.source(seq) == "model" else 0

    def start(self, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        self.ngram.start(seq, params, generator)
        self.model.start(seq, params, generator)

    def propose(self, seq: TokenSequence, k: int) -> Draft:
        if self.source(seq) == "ngram":
            draft = self.ngram.propose(seq, k)
            if draft.tokens.numel() > 0:
                self._last = self.ngram
                return draft
        self._last = self.model
        return self.model.propose(seq, k)

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        if self._last is not None:
            self._last.observe(seq, drafted, accepted)

    def reset(self) -> None:
        self.ngram.reset()
        self.model.reset()
