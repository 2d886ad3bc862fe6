"""Goodness-of-fit helpers for the distribution tests (no scipy needed)."""

from __future__ import annotations

import torch


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson chi-square goodness of fit of `counts` [V] to `probs` [V].

    Categories with expected count < 5 are pooled into one. Returns the p-value. An observed count in a
    category of probability 0 returns 0.0 (impossible outcome)."""
    counts = counts.double()
    probs = probs.double()
    n = counts.sum()
    if bool(((probs == 0) & (counts > 0)).any()):
        return 0.0
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    if df < 1:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    emp = counts.double() / counts.sum()
    return 0.5 * float((emp - probs.double()).abs().sum())
