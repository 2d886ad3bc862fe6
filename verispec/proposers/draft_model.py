"""A smaller causal LM drafts k tokens autoregressively from its own processed distribution q, for every drafting slot
of a round at once: each draft step feeds all the rows still drafting in ONE forward (a row feeds the one or two
committed tokens its cache has not seen, then its own last draft) and samples each row's token under that row's
own settings and RNG."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from verispec.backends.base import Model, common_prefix_length
from verispec.backends.quant import PACKED_MAX_ROWS
from verispec.core.draft import Draft
from verispec.core.grammar import GrammarRow, apply_masks
from verispec.core.rows import penalty_state, processed_rows
from verispec.core.sampling import SamplingParams, count_rows, presence_rows, sample
from verispec.core.sequence import TokenSequence
from verispec.names.drafters import Source
from verispec.proposers.base import DraftRow
from verispec.proposers.lookup import no_draft


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [n, Vd] -> [n, vocab_size]: extra entries cut, missing ones -inf (q = 0 there)."""
    width = logits.shape[-1]
    if width == vocab_size:
        return logits
    if width > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - width), -math.inf)
    return torch.cat([logits, pad], dim=-1)


def draft_token(
    logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None, counts: torch.Tensor | None,
    position: int, rng: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token [1] from draft logits [1, V] under the request's processing: the argmax (greedy;
    q None: one-hot) or a sample from q [1, V], which is returned for the rejection sampler."""
    processed = processed_rows(logits, params, presence, counts, position)  # the argmax [1] (greedy) or q [1, V]
    if params.greedy:
        return processed, None
    return sample(processed, rng), processed


def after_token(
    presence: torch.Tensor | None, counts: torch.Tensor | None, token: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The penalties' token presence [V] and counts [V] once `token` [1] is drafted (None stays None)."""
    if presence is not None:
        presence = presence_rows(presence, token)[-1]
    if counts is not None:
        counts = count_rows(counts, token)[-1]
    return presence, counts


def draft_step(model: Model, slots: list[int], feeds: list[torch.Tensor]) -> list[torch.Tensor]:
    """One draft step over the rows (each feeds its tokens [n]; its last position's logits [1, V] come back), in
    forwards of at most PACKED_MAX_ROWS token rows: a quantised draft's packed kernels then compute every row as
    they would alone (see verispec.backends.quant), so a row's q never depends on how many rows share the step."""
    per_forward = max(1, PACKED_MAX_ROWS // max(f.numel() for f in feeds))
    logits = []
    for at in range(0, len(slots), per_forward):
        logits += model.forward_rows(slots[at : at + per_forward], feeds[at : at + per_forward], last_only=True)
    return logits


class DraftModel:
    """Drafts with `model` (a Model of as many slots as the round's target). Per slot, the cache holds a prefix of
    the committed sequence (plus, mid-round, its own drafts); after verification it is rolled back to what was
    committed, and the next draft first feeds the committed tokens it has not seen (one, or two when all drafts
    were accepted: it never processed its own last draft). A slot that is further behind (a new prompt, or rounds
    decoded without drafting) catches up in a pass of its own, alone and whole: a quantised draft's kernels compute
    a part of a few rows differently from a whole prompt, so parts sized by the batch mates would make a seeded
    row's draws depend on them. A new sequence keeps the prefix it shares with the slot's last one, unless its draws
    must reproduce (seeded and sampled: see start)."""

    def __init__(self, model: Model, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's
        slots = model.slots
        self._held: list[tuple[TokenSequence | None, int]] = [(None, 0)] * slots  # (seq, its tokens in the cache)
        self._settings: list[tuple[SamplingParams, torch.Generator | None]] = [(SamplingParams(), None)] * slots
        self._base = [0] * slots  # len(seq) when the slot's last draft started
        self._grammars: list[GrammarRow | None] = [None] * slots

    def start(self, slot: int, seq: TokenSequence, params: SamplingParams, rng: torch.Generator,
              grammar: GrammarRow | None = None, texts: Sequence[Sequence[int]] = ()) -> None:
        """Keep the cached prefix this sequence shares with the slot's last, unless the sequence is seeded and
        sampled (it prefills the draft anew: a draft's kernels can compute a prompt's tail after a cached prefix a
        few bits apart from the whole prompt, and a seeded sequence's draws must not depend on what ran before it);
        the rest is fed lazily (catch_up or the first draft), so a generation that never drafts (a k policy found
        it does not pay) never prefills the draft. A constrained sequence's q is masked by its `grammar` at every
        step, so that its drafts are ones the grammar allows."""
        self._settings[slot] = (params, rng)
        self._grammars[slot] = grammar
        held, n = self._held[slot]
        cached = held.ids[:n] if held is not None and not params.seeded_draws else []
        keep = min(common_prefix_length(cached, seq.ids), len(seq) - 1, self.model.lengths[slot])
        self.model.rollback(slot, keep)
        self._held[slot] = (seq, keep)

    def source(self, slot: int, seq: TokenSequence) -> str:
        return Source.MODEL

    def pending(self, slot: int, seq: TokenSequence) -> int:
        """Tokens to feed in a separate catch-up pass before the next propose (0 when its first draft step just feeds
        the last one or two committed tokens)."""
        behind = len(seq) - self.model.lengths[slot]
        return behind - 1 if behind > 2 else 0

    def catch_up(self, slot: int, seq: TokenSequence, limit: int | None = None) -> int:
        """Feed up to `limit` committed tokens the cache has not seen, in one pass of this slot alone, always leaving
        the last one for the first draft step. A one-token call (limit 1) is how a draft step's cost is measured:
        the token is one the draft must see anyway."""
        at = self.model.lengths[slot]
        n = len(seq) - 1 - at
        if limit is not None:
            n = min(n, limit)
        if n <= 0:
            return 0
        self.model.forward_rows([slot], [seq.device_ids[at : at + n]], logits_for=[0])
        self._held[slot] = (seq, self.model.lengths[slot])
        return n

    def propose(self, rows: list[DraftRow]) -> list[Draft]:
        drafts = [no_draft(seq) for _, seq, _, _ in rows]
        live = [i for i, (_, _, k, _) in enumerate(rows) if k > 0]
        if not live:
            return drafts
        feeds, state = {}, {}
        for i in live:
            slot, seq, _, _ = rows[i]
            feeds[i] = seq.device_ids[self.model.lengths[slot] :]  # unseen committed tokens (1 or 2 once caught up)
            self._base[slot] = len(seq)
            state[i] = (*penalty_state(seq, self._settings[slot][0], self.vocab_size), [], [])
        step, ended = 0, set()  # ended: rows whose grammar allows nothing after their last draft
        while live:
            logits = draft_step(self.model, [rows[i][0] for i in live], [feeds[i] for i in live])
            for i, row_logits in zip(live, logits):
                slot, seq, _, _ = rows[i]
                params, rng = self._settings[slot]
                presence, counts, tokens, probs = state[i]
                position = seq.new_tokens + step  # the target's row for this draft sees the same
                row_logits, grammar = align_vocab(row_logits, self.vocab_size), self._grammars[slot]
                if grammar is not None:
                    row_logits = apply_masks(row_logits, grammar.draft_mask())
                token, q = draft_token(row_logits, params, presence, counts, position, rng)
                if grammar is not None and not grammar.drafted(int(token)):
                    ended.add(i)
                presence, counts = after_token(presence, counts, token)
                tokens.append(token)
                if q is not None:
                    probs.append(q)
                state[i] = (presence, counts, tokens, probs)
                feeds[i] = token
            step += 1
            live = [i for i in live if rows[i][2] > step and i not in ended]
        for grammar in {self._grammars[rows[i][0]] for i in state} - {None}:
            grammar.end_draft()
        for i, (_, _, tokens, probs) in state.items():
            drafts[i] = Draft(torch.cat(tokens), torch.cat(probs) if probs else None, Source.MODEL, len(tokens))
        return drafts

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        # the cache holds seq[:base] + drafts[:drafted - 1]; the first `accepted` drafts were committed
        if drafted:
            keep = min(self.model.lengths[slot], self._base[slot] + accepted)
            self.model.rollback(slot, keep)
            self._held[slot] = (seq, keep)

    def swap(self, a: int, b: int) -> None:
        self.model.swap(a, b)
        for state in (self._held, self._settings, self._base, self._grammars):
            state[a], state[b] = state[b], state[a]

    def release(self, slot: int) -> None:
        pass  # the cache stays: the slot's next sequence keeps what it shares with this one

    def reset(self) -> None:
        self.model.reset()
        self._held = [(None, 0)] * self.model.slots
