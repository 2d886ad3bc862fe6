"""A smaller causal LM drafts k tokens autoregressively from its own processed distribution q."""

from __future__ import annotations

import math

import torch

from verispec.backends.base import Model, common_prefix_length
from verispec.core.draft import Draft
from verispec.core.sampling import (
    SamplingParams,
    count_rows,
    greedy_tokens,
    presence_rows,
    probs_from_logits,
    process_logits,
    sample,
    token_counts,
)
from verispec.core.sequence import TokenSequence
from verispec.names.drafters import Source


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
    position: int, generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One draft token [1] from draft logits [1, V] under the request's processing: the argmax (greedy;
    q None: one-hot) or a sample from q [1, V], which is returned for the rejection sampler."""
    if params.greedy:
        return greedy_tokens(process_logits(logits, params, presence, counts, position)), None
    q = probs_from_logits(logits, params, presence, counts, position)
    return sample(q, generator), q


def after_token(
    presence: torch.Tensor | None, counts: torch.Tensor | None, token: torch.Tensor
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The penalties' token presence [V] and counts [V] once `token` [1] is drafted (None stays None)."""
    if presence is not None:
        presence = presence_rows(presence, token)[-1]
    if counts is not None:
        counts = count_rows(counts, token)[-1]
    return presence, counts


class DraftModelProposer:
    """Drafts with `model`. Its cache holds a prefix of the committed sequence (plus, mid-round, its
    own drafts); after verification it is cropped to what was committed, and the next round first
    feeds the committed tokens it has not seen (one, or two when all drafts were accepted: it never
    processed its own last draft)."""

    def __init__(self, model: Model, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's
        # the committed tokens in the draft's cache: seq.ids[:_held_len] of the last sequence it drafted for
        self._held_seq: TokenSequence | None = None
        self._held_len = 0
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self._base = 0  # len(seq) when the last draft started

    def start(self, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        """Keep the cached prefix this sequence shares; the rest is fed lazily (catch_up or the first draft),
        so a generation that never drafts (a k policy found it does not pay) never prefills the draft."""
        self.params, self.generator = params, generator
        held = self._held_seq.ids[: self._held_len] if self._held_seq is not None else []
        keep = min(common_prefix_length(held, seq.ids), len(seq) - 1, self.model.length)
        self.model.rollback(keep)
        self._held_seq, self._held_len = seq, keep

    def source(self, seq: TokenSequence) -> str:
        return Source.MODEL

    def pending(self, seq: TokenSequence) -> int:
        """Tokens the next propose would feed in a separate catch-up pass (0 when it just feeds the last one
        or two committed tokens with its first draft step)."""
        behind = len(seq) - self.model.length
        return behind - 1 if behind > 2 else 0

    def catch_up(self, seq: TokenSequence, limit: int | None = None) -> int:
        """Feed up to `limit` committed tokens the cache has not seen, in one pass, always leaving the last
        one for the first draft step. A one-token call (limit 1) is how a draft step's cost is measured: the
        token is one the draft must see anyway."""
        at = self.model.length
        n = len(seq) - 1 - at
        if limit is not None:
            n = min(n, limit)
        if n <= 0:
            return 0
        self.model.forward(seq.device_ids[at : at + n], last_only=True)
        self._held_seq, self._held_len = seq, self.model.length
        return n

    def propose(self, seq: TokenSequence, k: int, depth: int | None = None) -> Draft:
        params = self.params
        if self.pending(seq):  # a prompt, or rounds decoded without this draft: one batched catch-up pass
            self.catch_up(seq)
        feed = seq.device_ids[self.model.length :]  # [1 or 2] committed tokens not yet seen
        self._base = len(seq)
        presence = seq.presence(self.vocab_size) if params.penalised else None
        counts = token_counts(seq.device_ids[seq.prompt_length :], self.vocab_size) if params.counted else None
        tokens, probs = [], []
        for step in range(k):
            logits = align_vocab(self.model.forward(feed, last_only=True)[-1:], self.vocab_size)  # [1, V]
            position = len(seq.generated) + step  # the target's row for this draft sees the same
            token, q = draft_token(logits, params, presence, counts, position, self.generator)
            presence, counts = after_token(presence, counts, token)
            tokens.append(token)
            if q is not None:
                probs.append(q)
            feed = token
        draft_tokens = torch.cat(tokens) if tokens else seq.device_ids.new_empty(0)
        draft_probs = torch.cat(probs) if probs else None
        return Draft(draft_tokens, draft_probs, Source.MODEL, len(tokens))

    def reset(self) -> None:
        self.model.reset()
        self._held_seq, self._held_len = None, 0

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        # The cache holds seq[:_base] + drafts[:drafted - 1]; the first `accepted` drafts were committed.
        keep = min(self.model.length, self._base + accepted)
        self.model.rollback(keep)
        self._held_seq, self._held_len = seq, keep
