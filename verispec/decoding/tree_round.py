"""A token tree's round (the tree drafter's draft): scored, verified and committed in one tree-masked pass of its
own row's slot (trees do not batch). verispec.core.tree verifies; the target must be a TreeModel (the lean path)."""

from __future__ import annotations

import torch

from verispec.backends.base import Model, TreeModel
from verispec.core.rows import TokenLogprob, token_logprobs, tree_rows
from verispec.core.sampling import SamplingParams
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.core.tree import TokenTree, verify_tree


def tree_round(target: Model, slot: int, seq: TokenSequence, tree: TokenTree, params: SamplingParams,
               rng: torch.Generator, logprobs: list[TokenLogprob] | None,
               top_logprobs: int) -> tuple[list[int], int, list[int]]:
    """Score, verify and commit `tree` for the sequence in `slot` in one tree-masked pass over its root (the last
    committed token) and nodes; the slot keeps the root and the accepted path, and `seq` the committed tokens (their
    logprobs appended to `logprobs` where asked for). A prompt not yet in the cache is fed first, in a pass of its
    own. Returns (committed ids, accepted count, accepted nodes)."""
    if not isinstance(target, TreeModel):
        raise ValueError("token trees need a target that verifies trees (the lean path)")
    device, length = seq.device_ids.device, len(seq)
    if target.lengths[slot] < length - 1:
        target.forward_rows([slot], [seq.device_ids[target.lengths[slot] : length - 1]], logits_for=[0])
    base = length - 1
    positions = device_tensor([base, *(base + d for d in tree.depths)], device)
    visible = torch.cat([torch.ones(len(tree) + 1, 1, dtype=torch.bool, device=device), tree.paths()], dim=1)
    logits = target.forward_tree(slot, torch.cat([seq.device_ids[-1:], tree.tokens]), positions, base, visible,
                                 base + tree.depth)
    path, token = verify_tree(tree_rows(logits, tree, params, seq), tree, params.greedy, rng)
    rows = [0] + [node + 1 for node in path]  # of logits: the rows that chose each committed token
    tokens = tree.tokens.tolist()
    committed = [tokens[node] for node in path] + [token]
    if logprobs is not None:
        logp = tree_rows(logits, tree, params, seq, log=True)[rows]
        logprobs.extend(token_logprobs(logp, committed, top_logprobs))
    target.compact(slot, base, rows)
    seq.extend(committed, device_tensor(committed, device))
    return committed, len(path), path
