"""The speculative decoding round, for every sequence being decoded at once, and the loop that runs it.

An engine holds up to `max_batch` requests (rows), one per slot of its target (a Model of that many slots); a
lone request is a batch of one, through the same round:

    plan: each row's k policy plans its draft -> draft: the drafter drafts every drafting row (a draft model
    runs each step for all of them in one forward) -> score: ONE target pass over every row's unseen committed
    tokens and drafts -> verify: each row on its own (its own sampling settings and RNG) -> one device ->
    host transfer of every row's outcome -> commit: each row's tokens appended, its slot rolled back to them, the
    drafter told what was accepted, the round settled (stats, stops, max_new_tokens).

Between rounds a row's target cache holds a prefix of its committed sequence, at most all but its last token. A
round feeds what the cache has not seen (the last committed token; for a request that just joined, its prompt)
followed by the drafts, and keeps the logits of the last k + 1 positions: p after the committed sequence and after
each draft. The verifier accepts n drafts and yields one more token (recovered or bonus); the slot is rolled back
to the committed tokens it has seen. So a joining request's prefill rides in the round's shared pass, and its first
round verifies drafts in the same pass, unless they would come from a draft model: that draft starts in the next
round (its prefill of the prompt with it), so the first token waits only for the target's prefill. With k = 0 a
round is plain decoding, through the same code (the baseline).
Prompts are fed at most `prefill_chunk` tokens per round in all (the oldest request's first), so a long prompt goes
in over several rounds while the other rows keep committing. A token tree (the tree drafter's draft) is verified in
a tree-masked pass of its own row; trees do not batch. A constrained row (structured output: verispec.core.grammar)
has its draft walked through its grammar before the pass and its logits masked after it; the tokens its grammar
forces are its draft, free.

A row's tokens depend only on its own prompt, settings and RNG, never on its batch mates: greedy rows equal
plain decoding, sampled rows follow the target's distribution (as far as the target computes a row the same in
any pass: see verispec.backends). Requests join between rounds (`add`) and leave when they finish or are
cancelled; the active rows keep the lowest slots (a leaving row's slot and the last row's swap their caches), so a
padded cache is read as one view. A slot's cache outlives its request: a request is admitted into the free slot
whose cache shares the longest prefix with its prompt, and keeps that prefix. A prompt is computed once for the rows
that share it (n choices of one prompt, requests of one system prompt): a row being prefilled copies the longest
prefix of its prompt that another row's cache holds, and waits while an older row still feeds more of it.

k: a fixed k is planned by `FixedK`; 'auto' by the engine's k policy (it learns across generations; the engine
knows no concrete policy: verispec.assembly picks one per drafter), row by row when the round has one row, and all
its rows at once when several rows share the pass (a SharedKPolicy weighs each draft against the width it adds to
the shared pass). The engine knows token ids only; text stops come in as a callback from the edge.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import replace

import torch

from verispec.backends.base import Model, common_prefix_length
from verispec.core.draft import Draft
from verispec.core.grammar import Grammars, apply_masks, walk_drafts
from verispec.core.infill import TokenPieces
from verispec.core.rows import commit, outcome, verify_rows
from verispec.core.sampling import SamplingParams, rng_for
from verispec.core.sequence import TokenSequence
from verispec.core.timing import Clock, device_tensor, sync
from verispec.decoding.policies.base import FixedK, KPolicy, Plan, RoundReport, RoundView, SharedKPolicy
from verispec.decoding.prefill import prefill_plan
from verispec.decoding.request import Committed, GenerationResult, Request, Resolved, StopFn, as_request, resolve
from verispec.decoding.round import settle
from verispec.decoding.row import Row, Turn
from verispec.decoding.tree_round import tree_round
from verispec.names.drafters import DRAFT_MODEL_SOURCES, Source
from verispec.names.k import DEFAULT_K, check_k
from verispec.proposers.base import Drafter
from verispec.proposers.lookup import no_draft

PREFILL_CHUNK = 512  # prompt tokens a round feeds at most, over all the rows still being prefilled
PLAIN = FixedK(0)  # the policy of a request decoded plainly (k = 0, or no drafter): one token a pass, no draft at all


class SpeculativeEngine:
    """Speculative decoding over one target and one drafter (None: plain decoding), for up to `target.slots`
    requests at once. Requests resolve against this target's EOS ids and the pair's context (`max_length`), so that
    a request means the same alone and in a batch. `target` must be a TreeModel for a tree drafter; `auto_policy`
    is the k policy of k = 'auto', needed only where 'auto' is asked for."""

    def __init__(
        self,
        target: Model,
        drafter: Drafter | None = None,
        eos_token_ids: Iterable[int] = (),
        k: int | str = DEFAULT_K,
        auto_policy: KPolicy | None = None,
        max_length: int | None = None,
        prefill_chunk: int = PREFILL_CHUNK,
        vocabulary: TokenPieces | None = None,
        grammars: Grammars | None = None,
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill_chunk must be >= 1, got {prefill_chunk}")
        self.target = target
        self.drafter = drafter
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.k = check_k(k)
        self.k_policy = auto_policy
        if k == "auto":
            self._check_auto()
        self.max_batch = target.slots
        self.max_length = min(target.max_length, max_length or target.max_length)  # the pair's context
        self.prefill_chunk = prefill_chunk
        self.vocabulary = vocabulary  # the token texts the infill sampler reads
        self.grammars = grammars  # compiles requests' constraints (None: the tokenizer cannot: no fast tokenizer)
        self.device = target.device
        self.walk_during_pass = self.device.type == "cuda"  # grammars walked while the device computes the pass
        self.active: list[Row] = []  # active[i] holds slot i
        self._held: list[list[int]] = [[] for _ in range(self.max_batch)]  # a free slot's cached ids
        self._clock = Clock(self.device)  # times the round's stages on the device's timeline

    def _check_auto(self) -> None:
        if self.k_policy is None:
            raise ValueError("k = 'auto' needs a k policy (auto_policy)")

    @property
    def free_slots(self) -> int:
        return self.max_batch - len(self.active)

    # -- requests in and out -------------------------------------------------------------------------

    def resolve(self, request: Request) -> Resolved:
        """Check a request against the pair (ValueError with a one-line reason) and resolve it."""
        resolved = resolve(request, max_length=self.max_length, vocab_size=self.target.vocab_size,
                           eos_ids=self.eos_token_ids, default_k=self.k, vocabulary=self.vocabulary)
        if resolved.k == "auto" and self.drafter is not None:
            self._check_auto()
        if resolved.constraint is not None:
            if self.grammars is None:
                raise ValueError("structured output needs the model's tokenizer as a fast (Rust) tokenizer")
            self.grammars.compile(resolved.constraint)  # ValueError: an invalid schema, regex or grammar
            resolved = replace(resolved, stop_ids=resolved.stop_ids | self.grammars.end_ids)
        return resolved

    def add(self, request: Request | Iterable[int], params: SamplingParams | None = None, *,
            stop: StopFn | None = None, **fields) -> Row:
        """Admit a request (a Request, or prompt ids with params and Request's other fields as keywords; `stop`:
        the test for its text stops, on token ids) into a free slot (ValueError: a bad request; RuntimeError: no
        free slot). It joins the next round, whose target pass feeds its prompt."""
        if not self.free_slots:
            raise RuntimeError(f"the batch is full: {self.max_batch} request(s) decoding (finish or close one first)")
        resolved = self.resolve(as_request(request, params, **fields))
        return self._admit(resolved, stop, resolved.new_result())

    def _admit(self, resolved: Resolved, stop: StopFn | None, result: GenerationResult) -> Row:
        slot, prompt = len(self.active), resolved.prompt_ids
        self._swap(slot, self._best_free(prompt))  # the free slot whose cache shares the most with the prompt
        k = 0 if self.drafter is None else resolved.k
        seq = TokenSequence(prompt, len(prompt) + resolved.max_new_tokens + 1, self.device)
        row = Row(resolved, self.k_policy if k == "auto" else PLAIN if k == 0 else FixedK(k), stop, result, seq,
                  rng_for(resolved.params, self.device), slot,
                  None if resolved.top_logprobs is None else [],
                  None if resolved.constraint is None else self.grammars.row(resolved.constraint))
        keep = min(common_prefix_length(self._held[slot], prompt), len(prompt) - 1, self.target.lengths[slot])
        self.target.rollback(slot, keep)  # the cache keeps what the prompt shares with the slot's last sequence
        result.stats.cached_tokens = keep
        if self.drafter is not None:
            self.drafter.start(slot, seq, resolved.params, row.rng, row.grammar, resolved.lookup_texts)
        row.policy.start()
        self.active.append(row)
        return row

    def cancel(self, row: Row) -> None:
        """Take a request out now (between rounds); its result keeps what was committed."""
        if any(r is row for r in self.active):
            self._leave(row)

    def abort(self) -> None:
        """Drop every request and every cache (after a round failed part-way: no cache is trusted)."""
        for row in self.active:
            row.done = True
        self.active = []
        self.reset()

    def reset(self) -> None:
        """Drop all cached state (both models' caches); no request may be active."""
        self.target.reset()
        self._held = [[] for _ in range(self.max_batch)]
        if self.drafter is not None:
            self.drafter.reset()

    def _leave(self, row: Row) -> None:
        """The row's slot is free; its cache stays, for a later request that shares a prefix with it. The active
        rows keep the lowest slots: the last one swaps into the hole."""
        row.done = True
        slot, last = row.slot, len(self.active) - 1
        if self.drafter is not None:
            self.drafter.release(slot)
        self._held[slot] = row.seq.ids[: self.target.lengths[slot]]
        if slot != last:
            moved = self.active[last]
            self._swap(slot, last)
            moved.slot = slot
            self.active[slot] = moved
        self.active.pop()

    def _best_free(self, prompt: list[int]) -> int:
        """The free slot whose cached sequence shares the longest prefix with `prompt` (the lowest on ties)."""
        free = range(len(self.active), self.max_batch)
        return max(free, key=lambda s: (common_prefix_length(self._held[s], prompt), -s))

    def _swap(self, a: int, b: int) -> None:
        """Slots a and b exchange their caches (the target's and the drafter's) and what they hold."""
        if a == b:
            return
        self.target.swap(a, b)
        if self.drafter is not None:
            self.drafter.swap(a, b)
        self._held[a], self._held[b] = self._held[b], self._held[a]

    # -- the round -----------------------------------------------------------------------------------

    def step(self) -> list[tuple[Row, Committed]]:
        """One round over every active request: plan, draft, score and verify, settle (the module's docstring).
        Returns each request's newly committed tokens (a request that committed nothing, its round cut by a stop or
        its prompt still being fed, is absent). Finished requests leave."""
        if not self.active:
            return []
        clock, start = self._clock, time.perf_counter()
        ready, parts = prefill_plan(self.active, self.target, self.prefill_chunk)
        turns, shared = self._plan(ready, parts)
        t1 = clock.mark()
        self._draft(turns)
        t2 = clock.mark()
        if turns and turns[0].asked.tree is not None:  # a token tree: its own tree-masked pass (trees do not batch)
            self._verify_tree(turns[0])
        else:
            self._verify(turns, parts)
        t3 = clock.mark()
        if parts and not turns:  # no outcome synced the round: the parts' time is read after the device's
            sync(self.device)
        self._book_parts(parts, clock.seconds(t2, t3) if parts else 0.0)
        stages = dict(draft_seconds=clock.seconds(t1, t2), verify_seconds=clock.seconds(t2, t3))
        reports = [self._settle(turn, stages, start, shared) for turn in turns]
        if shared:
            mine = [report for turn, report in zip(turns, reports) if turn.row.policy is self.k_policy]
            width = sum(turn.fed for turn in turns) + sum(parts.values())
            self.k_policy.observe_shared(mine, width, bool(parts) or any(report.first for report in mine))
        for turn in turns:
            if turn.row.done:
                self._leave(turn.row)
        return [(turn.row, turn.chunk) for turn in turns if turn.chunk]

    def _plan(self, rows: list[Row], parts: dict[Row, int]) -> tuple[list[Turn], bool]:
        """Each verifying row's turn, its plan from its k policy (its draft caught up where it will draft), and whether
        the round is shared: several rows share its pass and the rows with k = 'auto' are planned together (by a
        SharedKPolicy, for the pass's width)."""
        views = [self._view(row) for row in rows]
        shared = len(self.active) > 1 and isinstance(self.k_policy, SharedKPolicy)
        plans = [None if shared and row.policy is self.k_policy else row.policy.choose(view)
                 for row, view in zip(rows, views)]
        if shared:
            auto = [i for i, plan in enumerate(plans) if plan is None]
            width = (sum(len(row.seq) - self.target.lengths[row.slot] for row in rows) + sum(parts.values())
                     + sum(plan.k for plan in plans if plan is not None))
            for i, plan in zip(auto, self.k_policy.choose_shared([views[i] for i in auto], width, len(rows))):
                plans[i] = plan
        turns = [Turn(row, plan if row.grammar is None or row.policy is PLAIN else self._constrained(row, view, plan))
                 for row, view, plan in zip(rows, views, plans)]
        for turn in turns:
            self._catch_up(turn)
        return turns, shared

    def _constrained(self, row: Row, view: RoundView, plan: Plan) -> Plan:
        """A constrained row's plan: the tokens its grammar forces next, where there are any, as a free draft of
        their own (also in a first round: they cost no draft prefill); no token tree (a tree's nodes are not walked
        through the grammar)."""
        forced = row.grammar.forced(row.request.max_new_tokens - row.seq.new_tokens - 1)
        if forced:
            return Plan(len(forced), Draft(device_tensor(forced, self.device), None, Source.GRAMMAR))
        return Plan(0) if view.source == Source.TREE else plan

    def _view(self, row: Row) -> RoundView:
        """What the k policy sees before a row's round. A first round does not draft with a draft model (a chain
        or a tree): the request's first token then comes from the target's prefill alone, not after the draft's
        prefill and steps, which the next round makes. The rule reads only the request's own round (not what
        the draft's cache holds), so a seeded request draws alike whatever ran before it."""
        limit = row.request.max_new_tokens - row.seq.new_tokens - 1
        if self.drafter is None:
            return RoundView(row.seq, limit, Source.NONE, 0, lambda: None)
        slot, seq = row.slot, row.seq
        source = self.drafter.source(slot, seq)
        if not row.prefilled and source in DRAFT_MODEL_SOURCES:
            limit = 0
        return RoundView(seq, limit, source, self.drafter.pending(slot, seq), lambda: self._time_draft_step(row))

    def _time_draft_step(self, row: Row) -> float | None:
        """Seconds of one draft step, fed on the first token the draft must catch up on anyway (None: none
        pending). Booked as prefill; a one-off measurement, so it waits for the device."""
        t0 = time.perf_counter()
        fed = self.drafter.catch_up(row.slot, row.seq, 1)
        sync(self.device)
        seconds = time.perf_counter() - t0
        row.result.stats.prefill_seconds += seconds
        return seconds if fed else None

    def _catch_up(self, turn: Turn) -> None:
        """Feed the draft the committed tokens it has not seen, when it is about to draft (the seconds it took are
        read once the round has synced)."""
        row = turn.row
        if not turn.asks or not self.drafter.pending(row.slot, row.seq):
            return
        a = self._clock.mark()
        turn.caught = self.drafter.catch_up(row.slot, row.seq)
        b = self._clock.mark()
        turn.catchup_seconds = lambda: self._clock.seconds(a, b)

    def _draft(self, turns: list[Turn]) -> None:
        """Each turn's draft: the policy's own, the drafter's (every asking row in one call), or none."""
        asking = [turn for turn in turns if turn.asks]
        if asking:
            proposed = self.drafter.propose([(t.row.slot, t.row.seq, t.plan.k, t.plan.depth) for t in asking])
            for turn, draft in zip(asking, proposed):
                turn.asked = draft
        for turn in turns:
            if turn.asked is None:
                turn.asked = turn.plan.draft or no_draft(turn.row.seq)
            turn.unseen = len(turn.row.seq) - self.target.lengths[turn.row.slot]

    def _verify(self, turns: list[Turn], parts: dict[Row, int]) -> None:
        """Score every turn's draft in the round's one pass (beside the prompt parts), verify each row on its own,
        bring every outcome to the host in one transfer (the round's one sync), and commit each row."""
        rows = [turn.row for turn in turns]
        drafts, logits = self._score_masked(rows, [turn.asked for turn in turns], parts)
        verified = verify_rows([row.seq for row in rows], drafts, logits, [row.request.params for row in rows],
                               [row.rng for row in rows])
        if not turns:
            return
        host, at = torch.cat([outcome(n, nxt, draft) for (n, nxt), draft in zip(verified, drafts)]).tolist(), 0
        for turn, draft, row_logits, (_, nxt) in zip(turns, drafts, logits, verified):
            row, size = turn.row, 2 + draft.tokens.numel()
            turn.draft = draft
            turn.committed, turn.accepted = commit(row.seq, draft, host[at : at + size], nxt, row_logits,
                                                   row.request.params, row.logprobs, row.request.top_logprobs or 0)
            at += size

    def _verify_tree(self, turn: Turn) -> None:
        """Score, verify and commit a row's token tree in one tree-masked pass (verispec.decoding.tree_round)."""
        row, turn.draft = turn.row, turn.asked
        turn.committed, turn.accepted, turn.path = tree_round(
            self.target, row.slot, row.seq, turn.draft.tree, row.request.params, row.rng, row.logprobs,
            row.request.top_logprobs or 0)

    def _score_masked(self, rows: list[Row], proposed: list[Draft], parts: dict[Row, int]
                      ) -> tuple[list[Draft], list[torch.Tensor]]:
        """The drafts verified and their logits from the round's pass (`_score`), each constrained row's masked by its
        grammar along its draft. Where the device runs the pass on its own (`walk_during_pass`: CUDA) the host walks
        the grammars while it computes, over whole drafts (a forbidden token is rejected all the same); elsewhere
        the pass holds the host, and the walk comes first, cutting one-hot drafts before their first forbidden
        token (a narrower pass)."""
        grammars = [row.grammar for row in rows]
        tokens = [None if g is None else d.tokens.tolist() for g, d in zip(grammars, proposed)]  # before the pass
        if self.walk_during_pass:
            scored = self._score(rows, proposed, parts)
            drafts, masks = walk_drafts(grammars, proposed, tokens, cut=False)
        else:
            drafts, masks = walk_drafts(grammars, proposed, tokens)
            scored = self._score(rows, drafts, parts)
        return drafts, [row_logits if mask is None else apply_masks(row_logits, mask)
                        for row_logits, mask in zip(scored, masks)]

    def _score(self, rows: list[Row], drafts: list[Draft], parts: dict[Row, int]) -> list[torch.Tensor]:
        """Every verifying row's target logits [k_b + 1, V] from ONE pass over each row's unseen committed tokens
        (its last one, or its prompt) and drafts; the same pass feeds the other rows' prompt parts."""
        fed = []  # (slot, feed, logits kept, index among the verifying rows or None)
        for i, (row, draft) in enumerate(zip(rows, drafts)):
            unseen = row.seq.device_ids[self.target.lengths[row.slot] :]
            fed.append((row.slot, torch.cat([unseen, draft.tokens]), draft.tokens.numel() + 1, i))
        for row, n in parts.items():
            at = self.target.lengths[row.slot]
            fed.append((row.slot, row.seq.device_ids[at : at + n], 0, None))
        if not fed:
            return []
        fed.sort(key=lambda f: f[0])  # slot order: the active slots are one range, read as one view
        out = self.target.forward_rows([f[0] for f in fed], [f[1] for f in fed], logits_for=[f[2] for f in fed])
        logits: list[torch.Tensor] = [None] * len(rows)  # type: ignore[list-item]
        for (_, _, _, i), row_logits in zip(fed, out):
            if i is not None:
                logits[i] = row_logits
        return logits

    def _settle(self, turn: Turn, stages: dict[str, float], start: float, shared: bool) -> RoundReport:
        """After the pass: the row's caches back to its committed tokens, its grammar past them, its round reported
        (to its k policy, unless the round's shared policy takes every report at once) and settled (stats, stops,
        max_new_tokens: verispec.decoding.round)."""
        row, plan, draft = turn.row, turn.plan, turn.draft
        self.target.rollback(row.slot, len(row.seq) - 1)  # the cache keeps the committed tokens it has seen
        if turn.asks:
            self.drafter.observe(row.slot, row.seq, turn.asked.tokens.numel(), turn.accepted)  # it rolls back too
        if row.grammar is not None:
            row.grammar.commit(turn.committed)
        report = RoundReport(
            k=plan.k, source=draft.source if draft.tokens.numel() else "", drafted=draft.tokens.numel(),
            accepted=turn.accepted, fed=turn.fed, first=not row.prefilled, own_draft=plan.draft is not None,
            draft_steps=draft.steps, catchup_seconds=turn.catchup_seconds(), catchup_tokens=turn.caught,
            seconds=time.perf_counter() - start, tree=draft.tree, path=tuple(turn.path), **stages)
        if not (shared and row.policy is self.k_policy):
            row.policy.observe(report)
        self._prefill_done(row)
        settled = settle(row.seq, turn.committed, report, row.request, row.result, row.stop, row.logprobs, row.started)
        if settled.cut:  # what follows the stop leaves the cache too
            self.target.rollback(row.slot, min(self.target.lengths[row.slot], len(row.seq) - 1))
        row.done, turn.chunk = settled.done, settled.chunk
        return report

    def _book_parts(self, parts: dict[Row, int], seconds: float) -> None:
        """A part of each of these rows' prompts went into the round's pass."""
        for row in parts:
            row.result.stats.target_forwards += 1
            row.result.stats.target_seconds += seconds

    def _prefill_done(self, row: Row) -> None:
        """The row's prompt is all in: its prefill time is the wait for that, from `add` on."""
        if not row.prefilled:
            row.prefilled = True
            row.result.stats.prefill_seconds += time.perf_counter() - row.started

    # -- one request at a time -------------------------------------------------------------------------

    def generate(self, request: Request | Iterable[int], params: SamplingParams | None = None, *,
                 stop: StopFn | None = None, **fields) -> GenerationResult:
        """Generate one request to its end, alone in the engine (`add`'s arguments), its rounds the same as a
        batch's: token ids in and out. Text, streaming and serving go through verispec.pipeline.slots."""
        if self.active:
            raise RuntimeError("the engine is decoding other requests: generate needs it to itself")
        row = self.add(request, params, stop=stop, **fields)
        try:
            while not row.done:
                self.step()
        except BaseException:  # a round that raised (e.g. KeyboardInterrupt mid-pass) may leave a cache half updated
            self.abort()
            raise
        return row.result
