"""Token trees: several candidate continuations verified in one target pass, exactly.

A round's tree hangs from the *root*, the last committed token. Its nodes are draft tokens, each with a
parent (another node, or the root) and a depth (1 for the root's children); siblings carry distinct tokens,
and nodes are ordered so that every parent comes before its children. The target scores the root and all
nodes in one forward pass with a tree attention mask (a node sees the committed sequence, its ancestors and
itself) at positions len(seq) - 1 + depth, which gives p after every node.

Acceptance (exact for any tree whose candidates do not depend on the target): walk from the root; at each
node draw x from the target's processed p there (greedy: x = its argmax); if x is one of the node's
children, x is accepted and the walk goes on from that child, else x is emitted (the recovered token) and
the round ends; at a leaf, x is the bonus token. Every emitted token is a draw from the target's
distribution at its position, so the output is distributed exactly as the target's, whatever the tree.
It is the multi-draft rule of SpecInfer and Sequoia with deterministic candidates: for candidates c_1..c_n
taken one by one, accepting c_i with p'(c_i) (p' = p with the rejected candidates removed and renormalised),
which is the min(1, p'/q) rule with q one-hot, accepts c_i with probability exactly p(c_i) in total and
leaves norm(p without the candidates) for the recovered token: the same law as drawing x ~ p and matching.
A node's accepted length is therefore the target's mass on its children: a tree spends the verify pass's
spare rows on the draft's runner-up tokens where the draft is unsure.

Deterministic candidates are what makes a tree cheap to verify exactly: candidates *sampled* from the draft's
q would need q in the acceptance ratio and, drawn without replacement, a corrected q per sibling.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from verispec.core.sampling import sample

ROOT = -1  # the parent index of the root's children


@dataclass
class TokenTree:
    """A draft tree: node i holds tokens[i] under parents[i] (ROOT or an earlier node); `scores` the draft's
    probability of the node's path (the product of q along it; the k policy learns what it predicts)."""

    tokens: torch.Tensor  # [m] long, on the target's device
    parents: list[int]
    scores: list[float] = field(default_factory=list)
    depths: list[int] = field(init=False)
    children: list[dict[int, int]] = field(init=False)  # per row (0: the root, i + 1: node i): token -> node
    _paths: torch.Tensor | None = field(init=False, default=None, repr=False)

    def __post_init__(self) -> None:
        m = self.tokens.numel()
        if len(self.parents) != m or (self.scores and len(self.scores) != m):
            raise ValueError(f"a tree of {m} tokens needs {m} parents (and scores), got {len(self.parents)}")
        tokens = self.tokens.tolist()
        self.depths, self.children = [], [{} for _ in range(m + 1)]
        for i, parent in enumerate(self.parents):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i}'s parent {parent} does not come before it")
            self.depths.append(1 if parent == ROOT else self.depths[parent] + 1)
            siblings = self.children[parent + 1]
            if tokens[i] in siblings:
                raise ValueError(f"node {i} repeats its sibling's token {tokens[i]}")
            siblings[tokens[i]] = i

    def __len__(self) -> int:
        return len(self.parents)

    @classmethod
    def chain(cls, tokens: torch.Tensor) -> "TokenTree":
        """A tree of one branch: tokens[i] under tokens[i - 1]."""
        return cls(tokens, list(range(-1, tokens.numel() - 1)))

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def paths(self) -> torch.Tensor:
        """[m + 1, m] bool: row 0 (the root) sees no node, row i + 1 (node i) its ancestors and itself (built
        once per tree: the target's mask and the penalties' rows both use it)."""
        if self._paths is not None:
            return self._paths
        m = len(self)
        seen = torch.zeros(m + 1, m, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent != ROOT:
                seen[i + 1] = seen[parent + 1]
            seen[i + 1, i] = True
        self._paths = seen.to(self.tokens.device)
        return self._paths

    def path_to(self, node: int) -> list[int]:
        """The nodes from the root's child down to `node`."""
        path = []
        while node != ROOT:
            path.append(node)
            node = self.parents[node]
        return path[::-1]


def verify_tree(rows: torch.Tensor, tree: TokenTree, greedy: bool,
                rng: torch.Generator) -> tuple[list[int], int]:
    """Walk the tree (see the module docstring): (the accepted nodes, root to deepest; the token after them).
    rows: the target's argmax ids [m + 1] (greedy) or probs [m + 1, V], row 0 the root's."""
    choices = rows.tolist() if greedy else None
    path, row = [], 0
    while True:
        x = choices[row] if greedy else int(sample(rows[row : row + 1], rng))
        child = tree.children[row].get(x)
        if child is None:
            return path, x
        path.append(child)
        row = child + 1
