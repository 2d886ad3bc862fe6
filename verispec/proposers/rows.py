"""Drafters for a batch of sequences, one per slot of the batch engine (verispec.decoding.batch).

`RowDrafter` is what the batch engine asks of a drafter: the single-sequence proposer protocol with a slot
in front, and `propose` over all the round's rows at once. `BatchDraftModel` runs a draft LM over a
`LeanBatch`: each draft step feeds every row still drafting in ONE forward (ragged first step: a row feeds
the one or two committed tokens it has not seen), and samples each row's token under that row's own
settings and generator. `ProposerRows` gives each slot its own free proposer (n-gram, suffix lookup),
which needs no batching: it costs no forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from verispec.backends.base import SlotModel
from verispec.backends.quant import PACKED_MAX_ROWS
from verispec.core.draft import Draft
from verispec.core.sampling import SamplingParams, token_counts
from verispec.core.sequence import TokenSequence
from verispec.names.drafters import Source
from verispec.proposers.base import Proposer
from verispec.proposers.draft_model import after_token, align_vocab, draft_token

# a round's request of a row: (slot, its committed sequence, k)
RowRequest = tuple[int, TokenSequence, int]


def no_draft(seq: TokenSequence) -> Draft:
    return Draft(seq.device_ids.new_empty(0), None, "")


class RowDrafter(Protocol):
    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        """Slot `slot` starts drafting for a new sequence (nothing of an earlier one is kept)."""

    def source(self, slot: int, seq: TokenSequence) -> str:
        """Where the slot's next draft would come from ('none': none would be offered)."""

    def propose(self, rows: list[RowRequest]) -> list[Draft]:
        """Each row's draft of at most k tokens (k = 0: an empty draft), in the order of `rows`."""

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """After verification: `accepted` of the slot's `drafted` tokens were committed to `seq`."""

    def move(self, src: int, dst: int) -> None:
        """Slot src's state now belongs to slot dst (src is free afterwards)."""

    def release(self, slot: int) -> None:
        """The slot's sequence is done."""

    def reset(self) -> None:
        """Forget every slot."""


class BatchDraftModel:
    """A draft LM over a SlotModel (a LeanBatch), its steps batched over the round's rows. Per slot, the cache holds a
    prefix of the committed sequence (plus, mid-round, its own drafts); after verification it is rolled
    back to what was committed."""

    def __init__(self, model: SlotModel, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's
        self._settings: dict[int, tuple[SamplingParams, torch.Generator]] = {}
        self._base: dict[int, int] = {}  # len(seq) when the slot's last draft started

    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        self.model.reset(slot)
        self._settings[slot] = (params, generator)
        self._base[slot] = 0

    def source(self, slot: int, seq: TokenSequence) -> str:
        return Source.MODEL

    def _catch_up(self, slot: int, seq: TokenSequence) -> torch.Tensor:
        """Feed a slot that is more than two tokens behind (a new prompt) all but the last committed token,
        alone and whole (a prefill: in parts sized by its batch mates, a quantised draft's kernels would
        compute it differently, and a seeded row's draws would depend on them); returns the one or two tokens
        its first draft step feeds."""
        at = self.model.lengths[slot]
        if len(seq) - at > 2:
            self.model.forward_rows([slot], [seq.device_ids[at:-1]], keep=[0])
        return seq.device_ids[self.model.lengths[slot] :]

    def propose(self, rows: list[RowRequest]) -> list[Draft]:
        drafts = [no_draft(seq) for _, seq, _ in rows]
        live = [i for i, (_, _, k) in enumerate(rows) if k > 0]
        if not live:
            return drafts
        feeds = {i: self._catch_up(rows[i][0], rows[i][1]) for i in live}
        state = {}
        for i in live:
            slot, seq, _ = rows[i]
            params = self._settings[slot][0]
            self._base[slot] = len(seq)
            presence = seq.presence(self.vocab_size) if params.penalised else None
            counts = token_counts(seq.device_ids[seq.prompt_length :], self.vocab_size) if params.counted else None
            state[i] = (presence, counts, [], [])
        step = 0
        while live:
            logits = self._step([rows[i][0] for i in live], [feeds[i] for i in live])
            for i, row_logits in zip(live, logits):
                slot, seq, _ = rows[i]
                params, generator = self._settings[slot]
                presence, counts, tokens, probs = state[i]
                position = len(seq.generated) + step  # the target's row for this draft sees the same
                token, q = draft_token(align_vocab(row_logits, self.vocab_size), params, presence, counts, position,
                                       generator)
                presence, counts = after_token(presence, counts, token)
                tokens.append(token)
                if q is not None:
                    probs.append(q)
                state[i] = (presence, counts, tokens, probs)
                feeds[i] = token
            step += 1
            live = [i for i in live if rows[i][2] > step]
        for i, (presence, counts, tokens, probs) in state.items():
            drafts[i] = Draft(torch.cat(tokens), torch.cat(probs) if probs else None, Source.MODEL, len(tokens))
        return drafts

    def _step(self, slots: list[int], feeds: list[torch.Tensor]) -> list[torch.Tensor]:
        """One draft step over the rows, in forwards of at most PACKED_MAX_ROWS token rows: a quantised
        draft's packed kernels then compute every row as they would alone (see verispec.backends.quant), so a row's q
        never depends on how many rows share the step."""
        per_forward = max(1, PACKED_MAX_ROWS // max(f.numel() for f in feeds))
        logits = []
        for at in range(0, len(slots), per_forward):
            logits += self.model.forward_rows(slots[at : at + per_forward], feeds[at : at + per_forward],
                                              last_only=True)
        return logits

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        # the cache holds seq[:base] + drafts[:drafted - 1]; the first `accepted` drafts were committed
        if drafted:
            self.model.rollback(slot, min(self.model.lengths[slot], self._base[slot] + accepted))

    def move(self, src: int, dst: int) -> None:
        self.model.move(src, dst)
        self.model.reset(src)
        self._settings[dst], self._base[dst] = self._settings.pop(src), self._base.pop(src)

    def release(self, slot: int) -> None:
        self.model.reset(slot)
        self._settings.pop(slot, None)
        self._base.pop(slot, None)

    def reset(self) -> None:
        self.model.reset()
        self._settings.clear()
        self._base.clear()


class ProposerRows:
    """One free proposer per slot, made by `make` (n-gram, suffix lookup: no forward to batch)."""

    def __init__(self, make: Callable[[], Proposer]) -> None:
        self.make = make
        self._by_slot: dict[int, Proposer] = {}

    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        proposer = self._by_slot[slot] = self.make()
        proposer.start(seq, params, generator)

    def source(self, slot: int, seq: TokenSequence) -> str:
        return self._by_slot[slot].source(seq)

    def propose(self, rows: list[RowRequest]) -> list[Draft]:
        return [self._by_slot[slot].propose(seq, k) if k > 0 else no_draft(seq) for slot, seq, k in rows]

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        self._by_slot[slot].observe(seq, drafted, accepted)

    def move(self, src: int, dst: int) -> None:
        self._by_slot[dst] = self._by_slot.pop(src)

    def release(self, slot: int) -> None:
        self._by_slot.pop(slot, None)

    def reset(self) -> None:
        self._by_slot.clear()
