"""The speculative decoding loop: propose -> verify -> commit/rollback, until a stop.

Invariant at the start of every round: the target's cache holds the committed sequence minus its
last token. A round feeds [last committed token, d_1 .. d_k] to the target in ONE forward pass, which
gives p for k+1 positions; the verifier accepts n drafts and yields one more token (recovered or
bonus); the target's cache is cropped to keep exactly the committed tokens it has seen. With k = 0 the
round is plain decoding, through the same sampling code: that is the baseline.

The first round is the exception: the prefill feeds the whole prompt and keeps its last row of logits
(p for the first new position), so that round feeds only [d_1 .. d_k] (nothing at all when k = 0), as
plain decoders do; feeding the prompt's last token again on its own would cost one more forward per
generation (~1% of a 96-token generation on llama.cpp).

A tree drafter's round (the draft carries a TokenTree) is the same round: one target pass over the root
and all nodes with a tree mask, the walk of verispec.core.tree instead of the chain's verifier, and the target's
cache keeps the accepted path (moved into place) instead of a prefix.

The engine knows token ids only. Text-level stops come in as a callback from the edge.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

import torch

from verispec.backends.base import Model, TreeModel, common_prefix_length
from verispec.core.draft import Draft
from verispec.core.rows import TokenLogprob, commit, token_logprobs, tree_rows, verify
from verispec.core.sampling import SamplingParams, make_generator
from verispec.core.sequence import TokenSequence
from verispec.core.timing import Clock, sync
from verispec.core.tree import TokenTree, verify_tree
from verispec.decoding.policies.base import FixedK, KPolicy, Plan, RoundReport, RoundView
from verispec.decoding.request import Committed, GenerationResult, Request, Resolved, StopFn, as_request, resolve
from verispec.decoding.round import settle
from verispec.decoding.stats import SpecStats
from verispec.names.drafters import Source
from verispec.names.k import DEFAULT_K, check_k
from verispec.proposers.base import Proposer


class Generation:
    """Iterate to get each round's newly committed tokens (`Committed`); `result` is filled as it goes.
    Closing the iterator early (a client went away) leaves the engine consistent."""

    def __init__(self, rounds: Iterator[Committed], result: GenerationResult) -> None:
        self._rounds = rounds
        self.result = result

    def __iter__(self) -> Iterator[Committed]:
        return self._rounds

    def close(self) -> None:
        self._rounds.close()  # type: ignore[attr-defined]


class SpeculativeGenerator:
    """One sequence's speculative decoding. `target` must be a TreeModel for a tree drafter; `auto_policy` is the
    k policy of k = 'auto' (it learns across generations; the engine knows no concrete policy: verispec.assembly
    picks one per drafter), needed only where 'auto' is asked for."""

    def __init__(
        self,
        target: Model | TreeModel,
        proposer: Proposer | None = None,
        eos_token_ids: Iterable[int] = (),
        num_draft_tokens: int | str = DEFAULT_K,
        auto_policy: KPolicy | None = None,
    ) -> None:
        self.target = target
        self.proposer = proposer
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.num_draft_tokens = check_k(num_draft_tokens)
        self.k_policy = auto_policy
        if num_draft_tokens == "auto":
            self._check_auto()
        self.device = target.device
        self._clock = Clock(self.device)  # times the round's stages on the device's timeline
        self._target_held: list[int] = []  # host copy of the committed tokens in the target's cache

    def _check_auto(self) -> None:
        if self.k_policy is None:
            raise ValueError("k = 'auto' needs a k policy (auto_policy)")

    # -- helpers ---------------------------------------------------------------------------------

    def _prefill(self, seq: TokenSequence) -> tuple[torch.Tensor, int]:
        """Bring the target's cache to all of seq, reusing the longest common prefix it already holds (at
        least the last token is fed: its logits are needed). Returns them, [1, V], and how many tokens it fed."""
        keep = min(common_prefix_length(self._target_held, seq.ids), len(seq) - 1, self.target.length)
        self.target.rollback(keep)
        head = self.target.forward(seq.device_ids[keep:], last_only=True)
        self._target_held = seq.ids[: self.target.length]
        return head, len(seq) - keep

    def _score(self, seq: TokenSequence, drafts: torch.Tensor, head: torch.Tensor | None) -> torch.Tensor:
        """The target's logits [k+1, V] for the positions after seq and after each draft: ONE forward pass
        over [last committed token, d_1 .. d_k] (the first round: over the drafts, the prefill gave `head`)."""
        if head is None:
            return self.target.forward(torch.cat([seq.device_ids[-1:], drafts]))
        return torch.cat([head, self.target.forward(drafts)]) if drafts.numel() else head

    def _catch_up(self, seq: TokenSequence, plan: Plan) -> int:
        """Feed the draft the committed tokens it has not seen, when it is about to draft; returns how many."""
        if plan.draft is not None or plan.k == 0 or not self.proposer.pending(seq):
            return 0
        return self.proposer.catch_up(seq)

    def _draft(self, seq: TokenSequence, plan: Plan) -> Draft:
        """The round's draft: the policy's own, the proposer's, or none (plain decoding)."""
        if plan.draft is not None:
            return plan.draft
        if plan.k == 0:
            return Draft(seq.device_ids.new_empty(0), None, "")
        return self.proposer.propose(seq, plan.k, plan.depth)

    def _score_tree(self, seq: TokenSequence, tree: TokenTree, head: torch.Tensor | None) -> tuple[torch.Tensor, int]:
        """The target's logits [m + 1, V] for the root and each tree node, in ONE tree-masked forward pass
        (over the root and the nodes; the first round: over the nodes, the prefill gave `head`), and the cache
        position where the pass's rows begin."""
        device = seq.device_ids.device
        length = len(seq)
        last = length - 1 + tree.depth
        positions = length - 1 + torch.tensor(tree.depths, dtype=torch.long, device=device)
        paths = tree.paths()  # [m + 1, m]
        if head is not None:
            return torch.cat([head, self.target.forward_tree(tree.tokens, positions, length, paths[1:], last)]), length
        tokens = torch.cat([seq.device_ids[-1:], tree.tokens])
        positions = torch.cat([positions.new_full((1,), length - 1), positions])
        visible = torch.cat([torch.ones(len(tree) + 1, 1, dtype=torch.bool, device=device), paths], dim=1)
        return self.target.forward_tree(tokens, positions, length - 1, visible, last), length - 1

    def _verify_tree(
        self, seq: TokenSequence, tree: TokenTree, params: SamplingParams, gen: torch.Generator,
        head: torch.Tensor | None, logprobs: list[TokenLogprob] | None, top_logprobs: int,
    ) -> tuple[list[int], list[int]]:
        """Score, verify and commit a tree (verispec.core.tree); the target's cache keeps the root and the accepted
        path. Returns (committed ids, accepted nodes)."""
        logits, base = self._score_tree(seq, tree, head)
        path, token = verify_tree(tree_rows(logits, tree, params, seq), tree, params.greedy, gen)
        rows = [0] + [node + 1 for node in path]  # of logits: the rows that chose each committed token
        tokens = tree.tokens.tolist()
        committed = [tokens[node] for node in path] + [token]
        if logprobs is not None:
            logp = tree_rows(logits, tree, params, seq, log=True)[rows]
            logprobs.extend(token_logprobs(logp, committed, top_logprobs))
        self.target.keep(base, rows if head is None else path)  # the first round's cache has no root row
        seq.extend(committed, torch.tensor(committed, device=seq.device_ids.device))
        return committed, path

    def _round(
        self, seq: TokenSequence, plan: Plan, params: SamplingParams, gen: torch.Generator,
        head: torch.Tensor | None, logprobs: list[TokenLogprob] | None, top_logprobs: int,
    ) -> tuple[list[int], RoundReport]:
        """One round, as the paper has it: propose -> one target pass -> verify -> commit and roll back.
        `head`: the first round's logits for the position after seq, from the prefill. `logprobs`: a list to
        append each committed token's TokenLogprob to (None: not asked for)."""
        clock, start = self._clock, time.perf_counter()
        t0 = clock.mark()
        caught_up = self._catch_up(seq, plan)
        t1 = clock.mark()
        draft = self._draft(seq, plan)
        t2 = clock.mark()
        path: list[int] = []
        if draft.tree is not None:
            committed, path = self._verify_tree(seq, draft.tree, params, gen, head, logprobs, top_logprobs)
            t3, accepted = clock.mark(), len(path)
        else:
            logits = self._score(seq, draft.tokens, head)
            n, nxt = verify(seq, draft, logits, params, gen)
            t3 = clock.mark()
            committed, accepted = commit(seq, draft, n, nxt, logits, params, logprobs, top_logprobs)
        drafted = draft.tokens.numel()
        self.target.rollback(len(seq) - 1)  # the target's cache keeps exactly the committed tokens it has seen
        if plan.draft is None and plan.k > 0:
            self.proposer.observe(seq, drafted, accepted)  # the draft rolls back its own cache
        return committed, RoundReport(
            k=plan.k, source=draft.source if drafted else "", drafted=drafted, accepted=accepted, first=head is not None,
            own_draft=plan.draft is not None, draft_steps=draft.steps, draft_seconds=clock.seconds(t1, t2),
            verify_seconds=clock.seconds(t2, t3), catchup_seconds=clock.seconds(t0, t1), catchup_tokens=caught_up,
            seconds=time.perf_counter() - start, tree=draft.tree, path=tuple(path))

    # -- the loop ----------------------------------------------------------------------------------

    def _rounds(self, request: Resolved, policy: KPolicy, stop: StopFn | None,
                result: GenerationResult) -> Iterator[Committed]:
        """Prefill, then rounds until max_new_tokens or a stop; yields each round's committed tokens."""
        stats, t_start = result.stats, time.perf_counter()
        prompt_ids, params, max_new_tokens = request.prompt_ids, request.params, request.max_new_tokens
        top_logprobs = request.top_logprobs
        seq = TokenSequence(prompt_ids, len(prompt_ids) + max_new_tokens + 1, self.device)
        gen = make_generator(params.seed, self.device)
        head, fed = self._prefill(seq)
        sync(self.device)  # the first round waits for the prefill's logits anyway
        policy.start(time.perf_counter() - t_start, fed)
        if self.proposer is not None:
            self.proposer.start(seq, params, gen)
        stats.prefill_seconds = time.perf_counter() - t_start
        logprobs = None if top_logprobs is None else []
        try:
            while True:
                plan = policy.choose(self._view(seq, max_new_tokens, stats))
                committed, report = self._round(seq, plan, params, gen, head, logprobs, top_logprobs or 0)
                head = None
                policy.observe(report)
                settled = settle(seq, committed, report, request, result, stop, logprobs, t_start)
                if settled.cut:  # what follows the stop leaves the caches too
                    self.target.rollback(min(self.target.length, len(seq) - 1))
                if settled.chunk:
                    yield settled.chunk
                if settled.done:
                    return
        finally:  # what the target's cache holds, for prefix reuse by the next generation
            self._target_held = seq.ids[: self.target.length]

    def _view(self, seq: TokenSequence, max_new_tokens: int, stats: SpecStats) -> RoundView:
        """What the k policy sees before a round."""
        proposer = self.proposer
        if proposer is None:
            return RoundView(seq, 0, Source.NONE, 0, lambda: None)
        return RoundView(seq, max_new_tokens - len(seq.generated) - 1, proposer.source(seq), proposer.pending(seq),
                         lambda: self._time_draft_step(seq, stats))

    def _time_draft_step(self, seq: TokenSequence, stats: SpecStats) -> float | None:
        """Seconds of one draft step, fed on the first token the draft must catch up on anyway (None: none
        pending). Booked as catch-up; a one-off measurement, so it waits for the kernels."""
        t0 = time.perf_counter()
        fed = self.proposer.catch_up(seq, 1)
        sync(self.device)
        seconds = time.perf_counter() - t0
        stats.prefill_seconds += seconds
        return seconds if fed else None

    def stream(self, request: Request | Iterable[int], params: SamplingParams | None = None, *,
               stop: StopFn | None = None, **fields) -> Generation:
        """Generate round by round: a Request, or prompt ids with params and Request's other fields as
        keywords. `stop`: the test for the request's text stops, on token ids (the engine knows no text)."""
        resolved = self.resolve(as_request(request, params, **fields))
        result = resolved.new_result()
        policy = self.k_policy if resolved.k == "auto" else FixedK(resolved.k)
        return Generation(self._guarded(self._rounds(resolved, policy, stop, result)), result)

    def resolve(self, request: Request) -> Resolved:
        """Check a request against the target (ValueError with a one-line reason) and resolve it."""
        resolved = resolve(request, max_length=self.target.max_length, vocab_size=self.target.vocab_size,
                           eos_ids=self.eos_token_ids, default_k=self.num_draft_tokens)
        if resolved.k == "auto":
            self._check_auto()
        return resolved

    def _guarded(self, rounds: Iterator[Committed]) -> Iterator[Committed]:
        """An exception inside a round (e.g. KeyboardInterrupt mid-forward) may leave a cache half
        updated: forget both caches then, so the next generation starts clean. Closing the generation
        between rounds (GeneratorExit at a yield) is a consistent point and keeps them."""
        try:
            yield from rounds
        except GeneratorExit:
            raise
        except BaseException:
            self.reset()
            raise

    def reset(self) -> None:
        """Drop all cached state (both models' KV caches)."""
        self.target.reset()
        self._target_held = []
        if self.proposer is not None:
            self.proposer.reset()

    def generate(self, request: Request | Iterable[int], params: SamplingParams | None = None, *,
                 stop: StopFn | None = None, **fields) -> GenerationResult:
        """Generate to the end (the arguments of `stream`)."""
        generation = self.stream(request, params, stop=stop, **fields)
        for _ in generation:
            pass
        return generation.result

