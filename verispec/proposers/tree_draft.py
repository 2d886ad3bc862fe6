"""A draft model grows a token tree (verispec.core.tree) under a node budget: EAGLE-2's dynamic expansion.

Each draft forward expands a *frontier* of up to `width` nodes at once (one tree-masked forward over them,
so a depth costs one draft step, as a chain's token does): every frontier node offers its `width` most
likely next tokens as candidates, scored by the draft's probability of the whole path (the product of q
along it); the `width` best candidates of the depth become the next frontier. After `depth` forwards the
tree keeps the `budget` best-scored candidates of all depths (a parent scores at least as high as its
children, so the kept nodes form a tree). The draft's confidence ranks where the runner-up tokens are
worth a verify row; the target's acceptance (verispec.core.tree) needs no q, so any ranking stays exact.

The ranking uses the request's temperature and top-k/top-p/min-p filters (greedy requests: the draft's
distribution at temperature 1), not its penalties: they would only reorder candidates, and exactness does
not depend on the order.
"""

from __future__ import annotations

import torch

from verispec.backends.base import TreeModel
from verispec.core.draft import Draft
from verispec.core.sampling import probs_from_logits
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.core.tree import ROOT, TokenTree
from verispec.names.drafters import Source
from verispec.proposers.base import DraftRow
from verispec.proposers.draft_model import DraftModel, align_vocab

TREE_WIDTH = 4  # frontier nodes per depth, and candidates per frontier node
TREE_DEPTH = 6  # draft forwards per tree (its deepest node), unless the k policy says otherwise


class TreeDraftModel(DraftModel):
    """Drafts token trees with `model` (a TreeModel: the lean path), one row at a time (trees do not batch).
    A row's `k` is the number of tree nodes; its `depth` the most draft forwards (at most max_depth and k)."""

    def __init__(self, model: TreeModel, vocab_size: int, width: int = TREE_WIDTH,
                 max_depth: int = TREE_DEPTH) -> None:
        super().__init__(model, vocab_size)
        if not isinstance(model, TreeModel):
            raise ValueError("token trees need a draft that verifies trees (the lean path)")
        if width < 1 or max_depth < 1:
            raise ValueError(f"width and max_depth must be >= 1, got {width} and {max_depth}")
        self.width, self.max_depth = width, max_depth
        self._trees: dict[int, tuple[TokenTree, dict[int, int]]] = {}  # slot -> its tree, and for each node it
        # fed, the node's row in the draft's cache after _base

    def source(self, slot: int, seq: TokenSequence) -> str:
        return Source.TREE

    def _ranking(self, slot: int, logits: torch.Tensor) -> torch.Tensor:
        """The draft's probabilities that rank candidates, [n, V]."""
        params = self._settings[slot][0].without_penalties()
        if params.greedy:
            return logits.float().softmax(dim=-1)
        return probs_from_logits(logits, params)

    def propose(self, rows: list[DraftRow]) -> list[Draft]:
        return [self._propose(slot, seq, k, depth) for slot, seq, k, depth in rows]

    def _propose(self, slot: int, seq: TokenSequence, k: int, depth: int | None) -> Draft:
        self._trees.pop(slot, None)
        empty = Draft(seq.device_ids.new_empty(0), None, Source.TREE)
        depth = min(self.max_depth, k, self.max_depth if depth is None else depth)
        if depth < 1:
            return empty
        feed = seq.device_ids[self.model.lengths[slot] :]  # committed tokens not yet seen (1 or 2 once caught up)
        self._base[slot] = base = len(seq)
        fed: dict[int, int] = {}  # node -> its row in the draft's cache after base
        last = self.model.forward_rows([slot], [feed], last_only=True)[0]
        q = self._ranking(slot, align_vocab(last, self.vocab_size))  # [1, V]
        # the pool of candidates: token, parent (pool index or ROOT), score, depth
        tokens: list[int] = []
        parents: list[int] = []
        scores: list[float] = []
        depths: list[int] = []
        frontier, frontier_scores = [ROOT], [1.0]
        seen: dict[int, list[int]] = {ROOT: []}  # fed node -> the cache rows (after base) it sees
        steps = 1
        for d in range(1, depth + 1):
            top = torch.topk(q, min(self.width, q.shape[-1]), dim=-1)
            values, ids = top.values.tolist(), top.indices.tolist()
            start = len(tokens)
            for f, parent in enumerate(frontier):
                for value, token in zip(values[f], ids[f]):
                    if value > 0.0:
                        tokens.append(token)
                        parents.append(parent)
                        scores.append(frontier_scores[f] * value)
                        depths.append(d)
            if d == depth or len(tokens) == start:
                break
            chosen = sorted(range(start, len(tokens)), key=lambda i: -scores[i])[: self.width]
            rows = []
            for node in chosen:
                fed[node] = len(fed)
                seen[node] = seen[parents[node]] + [fed[node]]
                rows.append(seen[node])
            visible = torch.zeros(len(chosen), len(fed), dtype=torch.bool)
            for r, cols in enumerate(rows):
                visible[r, cols] = True
            node_ids = device_tensor([tokens[i] for i in chosen], seq.device_ids.device)
            positions = torch.full((len(chosen),), base - 1 + d, dtype=torch.long, device=seq.device_ids.device)
            logits = self.model.forward_tree(slot, node_ids, positions, base, visible.to(seq.device_ids.device),
                                             last_position=base - 1 + d)
            q = self._ranking(slot, align_vocab(logits, self.vocab_size))
            frontier, frontier_scores = chosen, [scores[i] for i in chosen]
            steps += 1
        best = _best(parents, scores, depths, k)
        if not best:  # no candidate has q > 0 (e.g. a filter left none): no tree, the round decodes plainly
            self.model.rollback(slot, base)
            return empty
        index = {node: i for i, node in enumerate(best)}
        tree = TokenTree(device_tensor([tokens[i] for i in best], seq.device_ids.device),
                         [ROOT if parents[i] == ROOT else index[parents[i]] for i in best], [scores[i] for i in best])
        self._trees[slot] = (tree, {index[node]: row for node, row in fed.items() if node in index})
        return Draft(tree.tokens, None, Source.TREE, steps, tree)

    def observe(self, slot: int, seq: TokenSequence, drafted: int, accepted: int) -> None:
        """Keep in the draft's cache the accepted nodes it fed (in place after the base); it catches up on the
        rest next round, as a chain draft does on its last token."""
        if slot not in self._trees:  # nothing was drafted: the cache holds committed tokens only
            return
        (tree, fed), rows, base = self._trees.pop(slot), [], self._base[slot]
        node = ROOT
        for token in seq.ids[base : base + accepted]:
            node = tree.children[node + 1].get(token, None)
            if node is None or node not in fed:
                break
            rows.append(fed[node])
        self.model.compact(slot, base, rows)
        self._held[slot] = (seq, self.model.lengths[slot])


def _best(parents: list[int], scores: list[float], depths: list[int], budget: int) -> list[int]:
    """The `budget` best-scored candidates whose parents are kept too (ties: shallower first), in an order
    where parents come before children (by depth)."""
    kept: set[int] = set()
    for i in sorted(range(len(scores)), key=lambda i: (-scores[i], depths[i], i)):
        if parents[i] == ROOT or parents[i] in kept:
            kept.add(i)
            if len(kept) == budget:
                break
    return sorted(kept, key=lambda i: (depths[i], i))
