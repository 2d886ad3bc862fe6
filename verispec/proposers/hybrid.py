"""Hybrid drafting: a free lookup drafter (n-gram or suffix) when it has a confident match, the draft model
otherwise."""

from __future__ import annotations

import torch

from verispec.core.draft import Draft
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.names.drafters import Source
from verispec.proposers.draft_model import DraftModelProposer
from verispec.proposers.ngram import NgramProposer
from verispec.proposers.suffix import SuffixProposer

Lookup = NgramProposer | SuffixProposer
CONFIDENT = frozenset({Source.NGRAM, Source.SUFFIX})  # the lookup drafters' sources for a long (confident) match


class HybridProposer:
    """The lookup drafter when it has a confident match (its long kind: a suffix of at least its
    `min_confident` tokens), the draft model otherwise. Sources: the lookup's ('ngram' or 'suffix') and
    'model', so that a k policy can switch the draft model off while free lookup drafts keep going. The draft
    model catches up on the tokens it skipped the next time it drafts."""

    def __init__(self, lookup: Lookup, model: DraftModelProposer) -> None:
        self.lookup, self.model = lookup, model
        self._last: Lookup | DraftModelProposer | None = None

    def source(self, seq: TokenSequence) -> str:
        source = self.lookup.source(seq)
        return source if source in CONFIDENT else Source.MODEL

    def pending(self, seq: TokenSequence) -> int:
        return self.model.pending(seq) if self.source(seq) == Source.MODEL else 0

    def catch_up(self, seq: TokenSequence, limit: int | None = None) -> int:
        return self.model.catch_up(seq, limit) if self.source(seq) == Source.MODEL else 0

    def start(self, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        self.lookup.start(seq, params, generator)
        self.model.start(seq, params, generator)

    def propose(self, seq: TokenSequence, k: int, depth: int | None = None) -> Draft:
        if self.source(seq) != Source.MODEL:
            draft = self.lookup.propose(seq, k)
            if draft.tokens.numel() > 0:
                self._last = self.lookup
                return draft
        self._last = self.model
        return self.model.propose(seq, k)

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        if self._last is not None:
            self._last.observe(seq, drafted, accepted)

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()
