"""A smaller causal LM drafts k tokens autoregressively from its own processed distribution q."""

from __future__ import annotations

import math
import time

import torch

from verispec.backends.base import Model, common_prefix_length
from verispec.proposers.base import Draft
from verispec.sampling import (
    SamplingParams,
    count_rows,
    greedy_tokens,
    presence_rows,
    probs_from_logits,
    process_logits,
    sample,
    token_counts,
)
from verispec.sequence import TokenSequence
from verispec.timing import Clock, sync


def align_vocab(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Draft logits [n, Vd] -> [n, vocab_size]: extra entries cut, missing ones -inf (q = 0 there)."""
    width = logits.shape[-1]
    if width == vocab_size:
        return logits
    if width > vocab_size:
        return logits[..., :vocab_size]
    pad = logits.new_full((*logits.shape[:-1], vocab_size - width), -math.inf)
    return torch.cat([logits, pad], dim=-1)


class DraftModelProposer:
    """Drafts with `model`. Its cache holds a prefix of the committed sequence (plus, mid-round, its
    own drafts); after verification it is cropped to what was committed, and the next round first
    feeds the committed tokens it has not seen (one, or two when all drafts were accepted: it never
    processed its own last draft)."""

    uses_model = True

    def __init__(self, model: Model, vocab_size: int) -> None:
        self.model = model
        self.vocab_size = vocab_size  # the target's
        # the committed tokens in the draft's cache: seq.ids[:_held_len] of the last sequence it drafted for
        self._held_seq: TokenSequence | None = None
        self._held_len = 0
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self._base = 0  # len(seq) when the last draft started
        self.catchup_tokens = 0  # tokens the last propose's catch-up processed (see catchup_seconds)
        self._clock = Clock(model.device)
        self._catchup: tuple | None = None  # clock marks around the last propose's catch-up pass

    def start(self, seq: TokenSequence, params: SamplingParams, generator: torch.Generator) -> None:
        """Keep the cached prefix this sequence shares; the rest is prefilled lazily by the first draft,
        so a generation that never drafts (adaptive k found it does not pay) never prefills the draft."""
        self.params, self.generator = params, generator
        held = self._held_seq.ids[: self._held_len] if self._held_seq is not None else []
        keep = min(common_prefix_length(held, seq.ids), len(seq) - 1, self.model.length)
        self.model.rollback(keep)
        self._held_seq, self._held_len = seq, keep
        self._catchup, self.catchup_tokens = None, 0

    @property
    def catchup_seconds(self) -> float:
        """Seconds of the last propose's catch-up (prefill of the tokens it had not seen), not drafting: for
        the k policy. On a GPU read it after the round's sync (the clock's events must have completed)."""
        return self._clock.seconds(*self._catchup) if self._catchup is not None else 0.0

    def pending(self, seq: TokenSequence) -> int:
        """Tokens the next propose must first feed in one catch-up pass (0 when it just feeds the last one
        or two committed tokens with its first draft step)."""
        behind = len(seq) - self.model.length
        return behind - 1 if behind > 2 else 0

    def time_step(self, seq: TokenSequence) -> float | None:
        """Seconds of one draft forward over one token: a single-token pass over the first committed token the
        draft has not seen (its catch-up would feed it anyway, so it is not wasted, but it costs about a draft
        step more than within the batched catch-up). A model's first call can be slow; an estimate too high
        only delays drafting until the policy's next probe, which measures the cost afresh. None when fewer
        than two tokens are pending (the next draft then feeds them itself)."""
        at = self.model.length
        if len(seq) - at < 2:
            return None
        t0 = time.perf_counter()
        self.model.forward(seq.device_ids[at : at + 1], last_only=True)
        sync(self.model.device)  # a one-off measurement: wait for the kernels
        seconds = time.perf_counter() - t0
        self._held_seq, self._held_len = seq, self.model.length
        return seconds

    def propose(self, seq: TokenSequence, k: int) -> Draft:
        params = self.params
        feed = seq.device_ids[self.model.length :]  # [m >= 1] committed tokens not yet seen
        self._catchup, self.catchup_tokens = None, 0
        if feed.numel() > 2:  # a prompt, or rounds decoded without this draft: one batched catch-up pass
            start = self._clock.mark()
            self.model.forward(feed[:-1], last_only=True)
            self._catchup = (start, self._clock.mark())
            self.catchup_tokens = feed.numel() - 1
            feed = feed[-1:]
        self._base = len(seq)
        presence = seq.presence(self.vocab_size) if params.penalised else None
        counts = token_counts(seq.device_ids[seq.prompt_length :], self.vocab_size) if params.counted else None
        tokens, probs = [], []
        for step in range(k):
            logits = align_vocab(self.model.forward(feed, last_only=True)[-1:], self.vocab_size)  # [1, V]
            position = len(seq.generated) + step  # the target's row for this draft sees the same
            if params.greedy:
                token = greedy_tokens(process_logits(logits, params, presence, counts, position))  # [1]
            else:
                q = probs_from_logits(logits, params, presence, counts, position)  # [1, V]
                token = sample(q, self.generator)  # [1]
                probs.append(q)
            if presence is not None:
                presence = presence_rows(presence, token)[-1]
            if counts is not None:
                counts = count_rows(counts, token)[-1]
            tokens.append(token)
            feed = token
        draft_tokens = torch.cat(tokens) if tokens else seq.device_ids.new_empty(0)
        draft_probs = torch.cat(probs) if probs else None
        return Draft(draft_tokens, draft_probs)

    def reset(self) -> None:
        self.model.reset()
        self._held_seq, self._held_len = None, 0

    def observe(self, seq: TokenSequence, drafted: int, accepted: int) -> None:
        # The cache holds seq[:_base] + drafts[:drafted - 1]; the first `accepted` drafts were committed.
        keep = min(self.model.length, self._base + accepted)
        self.model.rollback(keep)
        self._held_seq, self._held_len = seq, keep
