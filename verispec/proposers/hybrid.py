"""Hybrid drafting: a free lookup drafter (n-gram or suffix) where it has a confident match, or a short one while
the draft model lags far behind; the draft model otherwise."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from verispec.core.draft import Draft
from verispec.core.grammar import GrammarRow
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.names.drafters import Source
from verispec.proposers.base import DraftRow
from verispec.proposers.cross_vocab import CrossVocabDraft
from verispec.proposers.draft_model import DraftModel
from verispec.proposers.lookup import LookupDrafter

CONFIDENT = frozenset({Source.NGRAM, Source.SUFFIX})  # the lookup drafters' sources for a long (confident) match
SHORT = frozenset({Source.NGRAM_SHORT, Source.SUFFIX_SHORT})  # their sources for a shorter match
# Where the draft model lags behind the sequence by more than this many of its own tokens (a long prompt it has not
# read, or a long stretch of confident lookup drafts), a short lookup match drafts instead: catching the model up is
# a pass over every token it skipped, which text that keeps copying its context (edits, summaries, long prompts of
# code) does not pay back in the few rounds the model would draft there.
LAG_MAX = 128


class HybridDrafter:
    """Per slot, the lookup drafter when it has a confident match (its long kind: a suffix of at least its
    `min_confident` tokens), or a short one while the draft model lags more than LAG_MAX tokens behind or cannot
    draft; the draft model otherwise. A round's model rows draft together. Sources: the lookup's ('ngram',
    'suffix' and their short kinds) and 'model', so that a k policy can switch the draft model off while free
    lookup drafts keep going. The draft model catches up on the tokens it skipped the next time it drafts."""

    def __init__(self, lookup: LookupDrafter, model: DraftModel | CrossVocabDraft) -> None:
        self.lookup, self.model = lookup, model
        # who drafted, per slot
        self._last: list[LookupDrafter | DraftModel | CrossVocabDraft | None] = [None] * model.model.slots

    def source(self, slot: int, seq: TokenSequence) -> str:
        source = self.lookup.source(slot, seq)
        if source in CONFIDENT or (source in SHORT and self._model_off(slot, seq)):
            return source
        return Source.MODEL

    def _model_off(self, slot: int, seq: TokenSequence) -> bool:
        """The draft model lags more than LAG_MAX tokens behind, or cannot draft."""
        return self.model.pending(slot, seq) > LAG_MAX or self.model.source(slot, seq) == Source.NONE

    def pending(self, slot: int, seq: TokenSequence) -> int:
        return self.model.pending(slot, seq) if self.source(slot, seq) == Source.MODEL else 0

    def catch_up(self, slot: int, seq: TokenSequence, limit: int | None = None) -> int:
        return self.model.catch_up(slot, seq, limit) if self.source(slot, seq) == Source.MODEL else 0

    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              grammar: GrammarRow | None = None, texts: Sequence[Sequence[int]] = ()) -> None:
        self.lookup.start(slot, seq, params, rng, texts=texts)
        self.model.start(slot, seq, params, rng, grammar)
        self._last[slot] = None

    def propose(self, rows: list[DraftRow]) -> list[Draft]:
        drafts: list[Draft | None] = [None] * len(rows)
        for i, row in enumerate(rows):
            slot, seq, k, _ = row
            source = self.source(slot, seq) if k > 0 else Source.MODEL
            if source != Source.MODEL:
                draft = self.lookup.propose([row])[0]
                if draft.tokens.numel() > 0 or source in SHORT or self._model_off(slot, seq):  # found nothing: the
                    drafts[i], self._last[slot] = draft, self.lookup  # model only where it is near enough to pay
        rest = [i for i, draft in enumerate(drafts) if draft is None]
        for i in rest:  # a confident lookup that found nothing near the model: the engine did not catch it up
            slot, seq, k, _ = rows[i]
            if k > 0 and self.model.pending(slot, seq):
                self.model.catch_up(slot, seq)
        for i, draft in zip(rest, self.model.propose([rows[i] for i in rest])):
            drafts[i] = draft
            self._last[rows[i][0]] = self.model
        return drafts

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        if self._last[slot] is not None:
            self._last[slot].observe(slot, seq, drafted, accepted)

    def swap(self, a: int, b: int) -> None:
        self.lookup.swap(a, b)
        self.model.swap(a, b)
        self._last[a], self._last[b] = self._last[b], self._last[a]

    def release(self, slot: int) -> None:
        self.lookup.release(slot)
        self.model.release(slot)

    def reset(self) -> None:
        self.lookup.reset()
        self.model.reset()
        self._last = [None] * len(self._last)
