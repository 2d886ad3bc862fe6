"""The logits -> distribution processing: the top-p candidate fast path against a full sort, and the
inverse-CDF sampler against its distribution."""

from __future__ import annotations

import math

import pytest
import torch
from stats_util import chi2_pvalue

from verispec.core import sampling
from verispec.core.sampling import SamplingParams, probs_from_logits, sample


def nucleus_by_full_sort(logits: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The obviously-right nucleus in float64: sort every row, keep the tokens whose strictly-better mass is
    below top_p. Returns (kept [n, V] bool, that mass's distance from top_p [n, V])."""
    ordered, order = torch.sort(logits.double(), dim=-1, descending=True)
    probs = ordered.softmax(dim=-1)
    before = probs.cumsum(dim=-1) - probs
    unsort = lambda t: torch.empty_like(t).scatter(-1, order, t)  # noqa: E731
    return unsort(before < top_p), unsort((before - top_p).abs())


def top_p_by_full_sort(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    return logits.masked_fill(~nucleus_by_full_sort(logits, top_p)[0], -math.inf)


def _rows(vocab: int = 5000) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    peaked = torch.randn(vocab, generator=gen) * 4  # nucleus inside the first 256 candidates
    flat = torch.randn(vocab, generator=gen) * 0.05  # nucleus of thousands: the candidate set must grow
    masked = peaked.clone()
    masked[::3] = -math.inf  # earlier filters (top-k, penalties) leave -inf entries
    return torch.stack([peaked, flat, masked])


@pytest.mark.parametrize("top_p", [0.05, 0.5, 0.9, 0.999])
def test_top_p_fast_path_equals_full_sort(top_p):
    """Same nucleus as a float64 full sort for every token not within rounding (1e-5) of the boundary."""
    rows = _rows()
    fast = sampling._filter_top_p(rows, top_p)
    kept, margin = nucleus_by_full_sort(rows, top_p)
    clear = margin > 1e-5
    assert torch.equal((fast > -math.inf)[clear], kept[clear])
    assert torch.equal(fast[fast > -math.inf], rows[fast > -math.inf])  # kept logits untouched
    if top_p == 0.9:  # the flat row needed more than the first candidates (the growth path ran)
        assert (fast[1] > -math.inf).sum() > sampling.TOP_P_CANDIDATES


def _tied_rows(n: int = 6, vocab: int = 4000, seed: int = 0) -> torch.Tensor:
    """Rows whose logits tie often, as bf16 logits do: values on a coarse grid."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(n, vocab, generator=gen) * 3).bfloat16().float().round()


def test_top_p_keeps_every_token_tied_with_the_cut():
    """100 tokens at logit 2, then 500 tied at 0: the mass reaches 0.7 inside the tied block, so all 500
    are in the nucleus (no sort order may choose among equal logits)."""
    row = torch.full((1, 4096), -20.0)
    row[0, :100] = 2.0
    row[0, 1000:1500] = 0.0
    kept = sampling._filter_top_p(row, 0.7) > -math.inf
    assert kept[0, :100].all() and kept[0, 1000:1500].all() and int(kept.sum()) == 600


@pytest.mark.parametrize("top_p", [0.3, 0.7, 0.95])
def test_top_p_of_a_row_does_not_depend_on_its_batch(top_p):
    """A verify pass filters k + 1 rows at once, plain decoding one: each row's nucleus must be the same
    alone as beside rows that make the candidate set grow (a flat row), with many tied logits."""
    rows = _tied_rows()
    flat = (torch.randn(1, rows.shape[1], generator=torch.Generator().manual_seed(5)) * 0.01).round()
    batch = sampling._filter_top_p(torch.cat([rows, flat]), top_p)[:-1]
    for i, row in enumerate(rows):
        alone = sampling._filter_top_p(row[None], top_p)[0]
        assert torch.equal(alone, batch[i]), i
        cut = alone[alone > -math.inf].min()
        assert torch.equal(alone > -math.inf, row >= cut), i  # closed under ties


def test_top_p_keeps_at_least_the_best_token():
    logits = torch.tensor([[10.0, 0.0, -1.0, -2.0]])
    assert (sampling._filter_top_p(logits, 0.01) > -math.inf).tolist() == [[True, False, False, False]]


def test_probs_from_logits_matches_reference_processing():
    rows = _rows()
    params = SamplingParams(temperature=0.7, top_p=0.9)
    reference = top_p_by_full_sort(rows / 0.7, 0.9).softmax(dim=-1)
    assert torch.allclose(probs_from_logits(rows, params), reference, atol=1e-7)


def test_sample_never_draws_zero_probability():
    probs = torch.zeros(4, 1000)
    probs[0, 0] = 1.0  # the first entry
    probs[1, 999] = 1.0  # the last entry
    probs[2, [10, 500]] = torch.tensor([1e-9, 1.0])  # a tiny one beside a big one
    probs[3, 1::2] = 1.0 / 500  # every other entry, unnormalised sums work too
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        drawn = sample(probs, gen)
        assert drawn[0] == 0 and drawn[1] == 999 and drawn[2] in (10, 500) and drawn[3] % 2 == 1


def test_sample_follows_the_distribution():
    """N = 20,000 draws from a 50-token distribution; false-failure probability 1e-4."""
    gen = torch.Generator().manual_seed(1)
    probs = torch.randn(50, generator=gen).exp() ** 2
    probs[[3, 17]] = 0.0
    probs /= probs.sum()
    draws = sample(probs.expand(20_000, 50), gen)
    counts = torch.bincount(draws, minlength=50)
    assert counts[3] == 0 and counts[17] == 0
    assert chi2_pvalue(counts, probs) > 1e-4


def test_sample_is_seeded():
    probs = torch.softmax(torch.randn(3, 100), dim=-1)
    a = sample(probs, torch.Generator().manual_seed(7))
    b = sample(probs, torch.Generator().manual_seed(7))
    assert torch.equal(a, b)


def test_greedy_tokens_is_torch_argmax():
    """The CPU fast path (numpy) picks what torch.argmax picks: the first index on ties, NaN as the max."""
    from verispec.core.sampling import greedy_tokens

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 151936, generator=gen)
    logits[1, 10] = logits[1, 99] = 1e4  # a tie: the first wins
    logits[2, :] = -math.inf
    logits[2, 5] = logits[2, 6] = 0.0
    logits[3, 42] = float("nan")
    out = greedy_tokens(logits)
    assert out.dtype == torch.long and out.device == logits.device
    assert torch.equal(out, logits.argmax(dim=-1))
    assert out[1].item() == 10 and out[2].item() == 5
    assert torch.equal(greedy_tokens(logits[:, ::2]), logits[:, ::2].argmax(dim=-1))  # not contiguous
    half = logits.bfloat16()  # no numpy dtype: torch's own argmax
    assert torch.equal(greedy_tokens(half), half.argmax(dim=-1))
