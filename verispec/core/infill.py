"""llama.cpp's infill sampler (code completion), as a transform of a processed distribution: what editors'
completion plugins ask llama-server for (`"samplers": ["top_k", "top_p", "infill"]`).

On each row's candidates (the tokens the filters before it left, best first):
1. when the end-of-generation tokens (EOG) hold enough of the mass (3 * p_eog * n > p_text over n candidates), only
   they remain: the completion ends where the model is unsure;
2. otherwise a token whose text is a prefix of another candidate's merges with it, into whichever of the two is
   likelier (its mass added, the other dropped), in llama.cpp's order (each candidate in turn against every other);
3. text tokens under 0.2 are dropped (none left: the end-of-text token alone, or where no end token was a candidate,
   as when min_tokens masks them, the likeliest text token), the rest renormalised, then text tokens under
   1 / (n_text + 1) dropped and the rest renormalised again.
Any row of p or q comes out a distribution, so speculative sampling over the transformed rows stays exact. The
candidates are read on the host (a row has at most `MAX_CANDIDATES` of them: llama.cpp's own loop is quadratic
in them too): a round under this sampler syncs the host once more per processed block of rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cached_property

import torch

from verispec.names.options import INFILL_TOP_K_MAX as MAX_CANDIDATES  # a row's tokens the infill sampler takes

TEXT_FLOOR = 0.2  # step 3's first threshold, llama.cpp's


class TokenPieces:
    """What the infill sampler reads of a vocabulary: each id's text as bytes (`pieces`, b"" for a special token,
    as llama.cpp renders a control token; read from `load` on first use, as a vocabulary of 150k tokens takes a
    third of a second), the ids that end generation, and the one it ends with when no text token is left
    (llama.cpp: its end-of-turn token, else its EOS; verispec.assembly gives the tokenizer's EOS, which for the
    instruct models is their end of turn)."""

    def __init__(self, load: Callable[[], Sequence[bytes]], eog: frozenset[int], end: int) -> None:
        self._load, self.eog, self.end = load, frozenset(eog), end

    @cached_property
    def pieces(self) -> Sequence[bytes]:
        return self._load()


def infill_row(probs: list[float], ids: list[int], vocab: TokenPieces) -> list[tuple[int, float]]:
    """One row's candidates (probabilities, their ids, best first) -> the transformed (id, probability) pairs."""
    n = len(ids)
    eog = [t in vocab.eog for t in ids]
    p_eog = sum(p for p, e in zip(probs, eog) if e)
    p_text = sum(p for p, e in zip(probs, eog) if not e)
    if 3 * p_eog * n > p_text:
        return [(t, p / p_eog) for t, p, e in zip(ids, probs, eog) if e]
    p = list(probs)
    gone = [False] * n
    pieces = [vocab.pieces[t] for t in ids]
    for i0 in range(n):
        for i1 in range(n):
            if gone[i0]:
                break
            if i0 == i1 or gone[i1]:
                continue
            a, b = pieces[i0], pieces[i1]
            if a and b.startswith(a):  # token i0 is a prefix of token i1: the likelier takes both
                dst, src = (i1, i0) if p[i1] > p[i0] else (i0, i1)
                p[dst] += p[src]
                p[src], gone[src] = 0.0, True
    kept = [i for i in range(n) if not gone[i] and (eog[i] or p[i] >= TEXT_FLOOR)]
    texts = sum(not eog[i] for i in kept)
    if texts == 0:  # the end token; where no end was a candidate (min_tokens masks them), the likeliest text token
        return [(vocab.end, 1.0)] if any(eog) else [(ids[max(range(n), key=lambda i: (p[i], -i))], 1.0)]
    total = sum(p[i] for i in kept)
    floor = 1.0 / (texts + 1)
    kept = [i for i in kept if eog[i] or p[i] / total >= floor]
    total = sum(p[i] for i in kept)
    return [(ids[i], p[i] / total) for i in kept]


def infill_rows(probs: torch.Tensor, vocab: TokenPieces) -> torch.Tensor:
    """[n, V] processed probabilities -> the infill sampler's [n, V] (see the module's docstring). Each row's
    candidates are its best MAX_CANDIDATES tokens with p > 0 (top_k asks no more; ties with the k-th can add a few,
    the lowest ids kept), best first, ties by id; one transfer to the host and one back."""
    best = torch.topk(probs.float(), min(MAX_CANDIDATES, probs.shape[-1]), dim=-1)
    values, indices = best.values.tolist(), best.indices.tolist()  # [n, m] on the host
    rows, cols, kept = [], [], []
    for r, (row_p, row_ids) in enumerate(zip(values, indices)):
        cands = sorted(((p, t) for p, t in zip(row_p, row_ids) if p > 0), key=lambda c: (-c[0], c[1]))
        for t, p in infill_row([p for p, _ in cands], [t for _, t in cands], vocab):
            rows.append(r)
            cols.append(t)
            kept.append(p)
    out = torch.zeros_like(probs)
    out[torch.tensor(rows, device=probs.device), torch.tensor(cols, device=probs.device)] = torch.tensor(
        kept, dtype=out.dtype, device=probs.device)
    return out
