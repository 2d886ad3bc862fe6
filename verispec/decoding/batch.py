"""Batched speculative decoding: many sequences, each round's target pass shared by all of them.

A `BatchGenerator` holds up to `max_batch` requests, one per slot of a `SlotModel` target (a LeanBatch: one
padded KV cache, a length per slot: see verispec.backends.lean for why that layout). A round is the single-sequence
round (verispec.decoding.engine) done for every active row at once:

  each row's k policy plans its k -> the drafter drafts every row (a draft model batches its steps over the
  rows) -> ONE target forward over every row's [last committed, d_1 .. d_k] (ragged) -> each row verified on
  its own (its own sampling settings and generator, the same `verify`/`commit` as a lone sequence) -> each
  slot rolled back to its committed tokens (O(1)).

Every row feeds the target what its cache has not seen yet: the last committed token, or, for a request that
just joined, its whole prompt. So a joining request's prefill rides in the next round's shared pass (the rows
are packed side by side there, not padded: see verispec.backends.lean) instead of stalling every running row
for a forward of its own; prompts are fed at most `prefill_chunk` tokens per round in all (the oldest
request's first, so a long prompt delays the prompts that came after it, never the rows decoding). A draft
model prefills a prompt whole, in its first draft (see verispec.proposers.rows). Requests join between rounds
(`add`) and leave when they finish or are cancelled; active requests are kept in the lowest slots (a leaving
row's slot is filled by moving the last row's cache into it), so the target reads the batch's caches as one
view. Exactness is per row: a row's tokens depend on its own prompt, settings and generator only, never on its
batch mates.

The k of "auto" in a batch is a fixed `BATCH_AUTO_K`: the cost-aware policy prices a lone sequence's target
pass, and in a batch that pass is shared.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from verispec.backends.base import SlotModel
from verispec.core.draft import Draft
from verispec.core.rows import TokenLogprob, commit, verify
from verispec.core.sampling import SamplingParams, make_generator
from verispec.core.sequence import TokenSequence
from verispec.core.timing import sync
from verispec.decoding.policies.base import FixedK, RoundReport, RoundView
from verispec.decoding.request import Committed, GenerationResult, Request, Resolved, StopFn, as_request, resolve
from verispec.decoding.round import settle
from verispec.names.drafters import Source
from verispec.names.k import BATCH_AUTO_K, DEFAULT_K, check_k
from verispec.proposers.rows import RowDrafter, no_draft

PREFILL_CHUNK = 512  # prompt tokens a round feeds at most, over all the rows still being prefilled


@dataclass(eq=False)
class BatchRequest:
    """One sequence in a batch: its resolved request, k and stop test. `result` fills as rounds commit; `done`
    once it finished or was cancelled."""

    request: Resolved
    policy: FixedK
    stop: StopFn | None
    result: GenerationResult
    done: bool = False
    slot: int = -1
    seq: TokenSequence | None = None
    generator: torch.Generator | None = None
    logprobs: list[TokenLogprob] | None = None
    started: float = field(default_factory=time.perf_counter)


class BatchGenerator:
    """Continuous batching of speculative decoding over one target and one drafter (None: plain decoding).
    Requests resolve as the single-sequence engine's do (verispec.decoding.request), with this target's EOS
    ids and the pair's context (`max_length`), so that a request means the same in a batch and alone."""

    def __init__(
        self,
        target: SlotModel,
        drafter: RowDrafter | None,
        eos_token_ids: Iterable[int] = (),
        num_draft_tokens: int | str = DEFAULT_K,
        max_length: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target = target
        self.prefill_chunk = prefill_chunk
        self.drafter = drafter
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.num_draft_tokens = check_k(num_draft_tokens)
        self.max_batch = target.slots
        self.max_length = min(target.max_length, max_length or target.max_length)  # the pair's context
        self.device = target.device
        self.active: list[BatchRequest] = []  # active[i] holds slot i

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.active)

    def add(self, request: Request | Iterable[int], params: SamplingParams | None = None, *,
            stop: StopFn | None = None, **fields) -> BatchRequest:
        """Admit a request (a Request, or prompt ids with params and Request's other fields as keywords; `stop`:
        the test for its text stops) into a free slot (ValueError: a bad request; RuntimeError: no free slot).
        It joins the next round, whose target pass prefills its prompt."""
        if not self.free_slots:
            raise RuntimeError(f"the batch is full ({self.max_batch} sequences)")
        resolved = self.resolve(as_request(request, params, **fields))
        k = BATCH_AUTO_K if resolved.k == "auto" else resolved.k
        if self.drafter is None:
            k = 0
        row = BatchRequest(resolved, FixedK(k), stop, resolved.new_result(), slot=len(self.active))
        prompt = resolved.prompt_ids
        row.seq = TokenSequence(prompt, len(prompt) + resolved.max_new_tokens + 1, self.device)
        row.generator = make_generator(resolved.params.seed, self.device)
        row.logprobs = None if resolved.top_logprobs is None else []
        self.target.reset(row.slot)
        if self.drafter is not None:
            self.drafter.start(row.slot, row.seq, resolved.params, row.generator)
        self.active.append(row)
        return row

    def resolve(self, request: Request) -> Resolved:
        """Check a request against the pair (ValueError with a one-line reason) and resolve it."""
        return resolve(request, max_length=self.max_length, vocab_size=self.target.vocab_size,
                       eos_ids=self.eos_token_ids, default_k=self.num_draft_tokens)

    def cancel(self, request: BatchRequest) -> None:
        """Take a request out of the batch now (between rounds); its result keeps what was committed."""
        if any(row is request for row in self.active):
            self._leave(request)

    def abort(self) -> None:
        """Drop every request and every slot's cache (after a round failed half-way: no cache is trusted)."""
        for request in self.active:
            request.done = True
        self.active = []
        self.target.reset()
        if self.drafter is not None:
            self.drafter.reset()

    def _leave(self, request: BatchRequest) -> None:
        request.done = True
        slot, last = request.slot, len(self.active) - 1
        if self.drafter is not None:
            self.drafter.release(slot)
        if slot != last:  # keep the active slots one range: the last row moves into the hole
            moved = self.active[last]
            self.target.move(last, slot)
            if self.drafter is not None:
                self.drafter.move(last, slot)
            moved.slot = slot
            self.active[slot] = moved
        self.target.reset(last)
        self.active.pop()

    def step(self) -> list[tuple[BatchRequest, Committed]]:
        """One round over every active request; returns each request's newly committed tokens (a request
        that committed nothing, its round cut by a stop or its prompt still being fed, is absent). Finished
        requests leave the batch."""
        if not self.active:
            return []
        start = time.perf_counter()
        ready, partial = self._prefill_plan()
        plans = [row.policy.choose(self._view(row)) for row in ready]
        drafts = (self.drafter.propose([(row.slot, row.seq, plan.k) for row, plan in zip(ready, plans)])
                  if self.drafter is not None and ready else [no_draft(row.seq) for row in ready])
        t_draft = time.perf_counter()
        logits = self._score(ready, drafts, partial)
        sync(self.device)
        t_score = time.perf_counter()
        for row in ready:  # its prompt is in: prefill_seconds is the wait for that, from `add` on
            if not row.result.stats.prefill_seconds:
                row.result.stats.prefill_seconds = t_score - row.started
        for row in partial:  # a part of its prompt went in this pass
            row.result.stats.target_forwards += 1
            row.result.stats.target_seconds += t_score - t_draft
        out = []
        for row, plan, draft, row_logits in zip(ready, plans, drafts, logits):
            params = row.request.params
            n, nxt = verify(row.seq, draft, row_logits, params, row.generator)
            committed, accepted = commit(row.seq, draft, n, nxt, row_logits, params, row.logprobs,
                                         row.request.top_logprobs or 0)
            self.target.rollback(row.slot, len(row.seq) - 1)
            drafted = draft.tokens.numel()
            if self.drafter is not None and plan.k > 0:
                self.drafter.observe(row.slot, row.seq, drafted, accepted)
            end = time.perf_counter()
            report = RoundReport(k=plan.k, source=draft.source if drafted else "", drafted=drafted, accepted=accepted,
                                 first=False, own_draft=False, draft_steps=draft.steps, draft_seconds=t_draft - start,
                                 verify_seconds=end - t_draft, catchup_seconds=0.0, catchup_tokens=0,
                                 seconds=end - start)
            settled = settle(row.seq, committed, report, row.request, row.result, row.stop, row.logprobs, row.started)
            if settled.cut:  # what follows the stop leaves the cache too
                self.target.rollback(row.slot, min(self.target.lengths[row.slot], len(row.seq) - 1))
            row.done = settled.done
            if settled.chunk:
                out.append((row, settled.chunk))
        for row in ready:
            if row.done:
                self._leave(row)
        return out

    def _prefill_plan(self) -> tuple[list[BatchRequest], dict[BatchRequest, int]]:
        """Which rows verify this round and which only feed part of their prompt (how many tokens): a row
        whose unseen prompt fits in what is left of `prefill_chunk` (the oldest requests first) verifies
        along with its prefill; the first that does not fit feeds what is left, and the rest wait."""
        budget, partial, waiting = self.prefill_chunk, {}, set()
        for row in sorted(self.active, key=lambda r: r.started):
            unseen = len(row.seq) - self.target.lengths[row.slot]
            if unseen <= 1:  # decoding: only its last committed token is new
                continue
            if unseen > budget:
                if budget:
                    partial[row] = budget
                else:
                    waiting.add(row)
            budget -= min(budget, unseen)
        return [row for row in self.active if row not in partial and row not in waiting], partial

    def _view(self, row: BatchRequest) -> RoundView:
        source = Source.NONE if self.drafter is None else self.drafter.source(row.slot, row.seq)
        return RoundView(row.seq, row.request.max_new_tokens - len(row.seq.generated) - 1, source, 0, lambda: None)

    def _score(self, ready: list[BatchRequest], drafts: list[Draft],
               partial: dict[BatchRequest, int]) -> list[torch.Tensor]:
        """Every ready row's target logits [k_b + 1, V] from ONE forward over each row's unseen committed
        tokens (its last one, or its prompt) and drafts; the same pass feeds the partial rows' prompt parts."""
        fed = []  # (slot, feed, logits kept, index among the ready rows or None)
        for i, (row, draft) in enumerate(zip(ready, drafts)):
            unseen = row.seq.device_ids[self.target.lengths[row.slot] :]
            fed.append((row.slot, torch.cat([unseen, draft.tokens]), draft.tokens.numel() + 1, i))
        for row, n in partial.items():
            at = self.target.lengths[row.slot]
            fed.append((row.slot, row.seq.device_ids[at : at + n], 0, None))
        if not fed:
            return []
        fed.sort(key=lambda f: f[0])  # slot order: the active slots are one range, read as one view
        out = self.target.forward_rows([f[0] for f in fed], [f[1] for f in fed], keep=[f[2] for f in fed])
        logits: list[torch.Tensor] = [None] * len(ready)  # type: ignore[list-item]
        for (_, _, _, i), row_logits in zip(fed, out):
            if i is not None:
                logits[i] = row_logits
        return logits
