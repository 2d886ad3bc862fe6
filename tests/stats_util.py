"""Goodness-of-fit helpers for the distribution tests (no scipy needed)."""

from __future__ import annotations

import torch

MIN_SAMPLES = 1000  # a position reached fewer times than this says nothing about its distribution


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor, min_samples: int = MIN_SAMPLES) -> float:
    """Pearson chi-square goodness of fit of `counts` [V] to `probs` [V].

    Categories with expected count < 5 are pooled into one. Returns the p-value. An observed count in a
    category of probability 0 returns 0.0 (impossible outcome). Never passes vacuously: fewer than
    `min_samples` observations, or fewer than two categories left to compare, raise AssertionError."""
    counts = counts.double()
    probs = probs.double()
    n = counts.sum()
    assert n >= min_samples, f"only {int(n)} samples reached this position (need {min_samples})"
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
    if int((probs > 0).sum()) == 1:  # a point mass: the impossible-outcome check above was the exact test
        return 1.0
    assert df >= 1, "fewer than two categories with expected count >= 5: the test cannot tell anything apart"
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def total_variation(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Total variation distance between the empirical distribution of `counts` and `probs`."""
    emp = counts.double() / counts.sum()
    return 0.5 * float((emp - probs.double()).abs().sum())


def seeded_results(engine, prompt: list[int], params, n: int, steps: int, seed0: int = 0, admitted=None,
                   **fields) -> list:
    """The GenerationResults of n seeded generations of `steps` tokens from one engine (seeds seed0, seed0 + 1, ...;
    `fields`: Request's other fields; `admitted(row)`, if given, sees each row as it joins). The engine decodes as
    many at once as it has slots (a freed slot takes the next seed at once): each row's tokens follow from its own
    seed, as alone, in fewer passes."""
    from dataclasses import replace

    waiting, rows = list(range(n)), []
    while waiting or engine.active:
        while waiting and engine.free_slots:
            seeded = replace(params, seed=seed0 + waiting.pop(0))
            rows.append(engine.add(prompt, seeded, max_new_tokens=steps, **fields))
            if admitted is not None:
                admitted(rows[-1])
        engine.step()
    return [row.result for row in rows]


def generation_histograms(engine, prompt: list[int], params, n: int, steps: int, vocab_size: int,
                          seed0: int = 0, **fields) -> tuple[torch.Tensor, int, int]:
    """Token counts [steps, V] per position over n seeded generations (`seeded_results`; `fields`: Request's other
    fields), with the drafted and accepted tokens summed over them."""
    counts = torch.zeros(steps, vocab_size, dtype=torch.long)
    results = seeded_results(engine, prompt, params, n, steps, seed0, **fields)
    for result in results:
        for pos, tok in enumerate(result.token_ids[:steps]):
            counts[pos, tok] += 1
    return counts, sum(r.stats.drafted for r in results), sum(r.stats.accepted for r in results)
