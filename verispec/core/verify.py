"""The rejection sampler of speculative decoding (Leviathan et al. 2023; Chen et al. 2023).

Names, once: p is the target's processed distribution, q the draft's. Each draft token x_i is
*accepted* with probability min(1, p_i(x_i) / q_i(x_i)). At the first rejection the token is
*recovered*: sampled from norm(max(0, p_i - q_i)). If all k drafts are accepted, a *bonus* token is
sampled from p_{k}. The emitted tokens are distributed exactly as p.

Deterministic drafts (greedy draft model, n-gram lookup) pass `draft_probs=None`: q is one-hot on
the drafted token, which is exact for sampling too.

Pure functions over tensors, batched over a leading dimension B; no model, cache or config inside.
"""

from __future__ import annotations

import torch

from verispec.core.sampling import sample


def acceptance_probability(p_x: torch.Tensor, q_x: torch.Tensor) -> torch.Tensor:
    """min(1, p(x)/q(x)) elementwise, without dividing by zero (q(x) = 0: accept iff p(x) > 0). A
    non-finite q(x) (an fp16 draft that overflowed) is rejected outright: NaN compares False with
    everything, so without the check it would pass as q = 0 and be accepted whenever p(x) > 0."""
    ratio = p_x / q_x.clamp_min(torch.finfo(q_x.dtype).tiny)
    accept = torch.where(q_x > 0, ratio.clamp(max=1.0), (p_x > 0).to(p_x.dtype))
    return torch.where(torch.isfinite(q_x), accept, torch.zeros_like(accept))


def recovery_distribution(p_row: torch.Tensor, q_row: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)) over the last dim. Where the residual has no mass at all (p <= q everywhere,
    so a rejection had probability 0) it falls back to p; any positive mass, however small, is the
    residual (a one-hot q on a token with p close to 1 leaves a tiny but exact residual)."""
    residual = (p_row - q_row).clamp_min(0.0)
    mass = residual.sum(dim=-1, keepdim=True)
    return torch.where(mass > 0, residual / mass.clamp_min(torch.finfo(mass.dtype).tiny), p_row)


def draft_probs_at(draft_probs: torch.Tensor | None, draft_tokens: torch.Tensor) -> torch.Tensor:
    """q_i(x_i) for each draft position: [B, k]. Deterministic drafts (None): 1."""
    if draft_probs is None:
        return torch.ones(draft_tokens.shape, device=draft_tokens.device)
    return draft_probs.float().gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)


def next_token_distribution(
    target_probs: torch.Tensor,  # [B, k+1, V] p
    draft_tokens: torch.Tensor,  # [B, k]
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None (one-hot on draft_tokens)
    num_accepted: torch.Tensor,  # [B]
) -> torch.Tensor:
    """The distribution of the token after the accepted drafts, [B, V]: recovered, norm(max(0, p_n - q_n)),
    at the first rejection n < k; the bonus, p_k itself, when all k were accepted."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=target_probs.device)
    p_row = target_probs[rows, num_accepted]  # [B, V]
    if k == 0:
        return p_row
    at = num_accepted.clamp(max=k - 1)
    if draft_probs is None:
        q_row = torch.zeros_like(p_row).scatter_(-1, draft_tokens[rows, at].unsqueeze(-1), 1.0)
    else:
        q_row = draft_probs[rows, at].float()  # [B, V]
    return torch.where((num_accepted == k).unsqueeze(-1), p_row, recovery_distribution(p_row, q_row))


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, k] long
    draft_probs: torch.Tensor | None,  # [B, k, V] q, or None for deterministic drafts
    target_probs: torch.Tensor,  # [B, k+1, V] p
    rng: torch.Generator,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (num_accepted [B] long, next_token [B] long): the recovered or bonus token."""
    B, k = draft_tokens.shape
    V = target_probs.shape[-1]
    assert target_probs.shape == (B, k + 1, V), f"target_probs {tuple(target_probs.shape)} != {(B, k + 1, V)}"
    target_probs = target_probs.float()
    num_accepted = torch.zeros(B, dtype=torch.long, device=target_probs.device)
    if k > 0:
        p_x = target_probs[:, :k].gather(-1, draft_tokens.unsqueeze(-1)).squeeze(-1)  # [B, k]
        q_x = draft_probs_at(draft_probs, draft_tokens)  # [B, k]
        u = torch.rand(B, k, generator=rng, device=target_probs.device)  # [0, 1)
        accepted = u < acceptance_probability(p_x, q_x)  # [B, k]; u = 0 never accepts a token with p = 0
        num_accepted = accepted.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    final = next_token_distribution(target_probs, draft_tokens, draft_probs, num_accepted)
    return num_accepted, sample(final, rng)


def greedy_verify(
    draft_tokens: torch.Tensor,  # [B, k] long
    target_argmax: torch.Tensor,  # [B, k+1] long
) -> tuple[torch.Tensor, torch.Tensor]:
    """Temperature 0: accept while the draft equals the target's argmax, then emit the target's argmax."""
    B, k = draft_tokens.shape
    rows = torch.arange(B, device=target_argmax.device)
    matches = draft_tokens == target_argmax[:, :k]  # [B, k]
    num_accepted = matches.long().cumprod(dim=-1).sum(dim=-1)  # [B]
    return num_accepted, target_argmax[rows, num_accepted]
