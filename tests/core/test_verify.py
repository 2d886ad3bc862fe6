"""The rejection sampler: exact math first, then sampling per draft position and the bonus token."""

from __future__ import annotations

import pytest
import torch
from stats_util import chi2_pvalue, total_variation

from verispec.core import verify
from verispec.core.sampling import SamplingParams, probs_from_logits
from verispec.core.verify import acceptance_probability, greedy_verify, recovery_distribution, rejection_sample

ALPHA = 1e-4  # per-test significance: the false-failure probability of each chi-square assertion


def _random_dist(gen: torch.Generator, shape, zeros: float = 0.0) -> torch.Tensor:
    logits = torch.randn(*shape, generator=gen, dtype=torch.float64) * 2
    if zeros:
        mask = torch.rand(*shape, generator=gen) < zeros
        mask[..., 0] = False  # keep at least one entry
        logits = logits.masked_fill(mask, float("-inf"))
    return logits.softmax(-1)


@pytest.mark.parametrize("seed", range(20))
def test_exact_mixture_equals_target(seed):
    """q·min(1, p/q) + (1 − Σ min(p, q))·norm(max(p − q, 0)) == p, with the verifier's own functions."""
    gen = torch.Generator().manual_seed(seed)
    V = 7
    p = _random_dist(gen, (V,), zeros=0.3 if seed % 2 else 0.0)
    q = _random_dist(gen, (V,), zeros=0.3 if seed % 3 else 0.0)
    accept = acceptance_probability(p, q)
    rejected_mass = 1 - torch.minimum(p, q).sum()
    emitted = q * accept + rejected_mass * recovery_distribution(p, q)
    torch.testing.assert_close(emitted, p, rtol=0, atol=1e-12)
    # and the rejection mass is what acceptance leaves over
    torch.testing.assert_close(rejected_mass, 1 - (q * accept).sum(), rtol=0, atol=1e-12)


def test_edges_q_zero_and_residual_zero():
    p = torch.tensor([0.5, 0.5, 0.0])
    q = torch.tensor([0.0, 1.0, 0.0])
    assert acceptance_probability(p, q).tolist() == [1.0, 0.5, 0.0]
    # p == q: residual is all zero -> fall back to p (never NaN)
    torch.testing.assert_close(recovery_distribution(p, p), p)
    assert torch.isfinite(recovery_distribution(p, p)).all()


def _emitted_counts(num_accepted, next_token, draft_tokens, position: int, V: int) -> torch.Tensor:
    """Histogram of the token emitted at `position` over the samples that reached it."""
    reached = num_accepted >= position
    token = torch.where(num_accepted > position, draft_tokens[:, min(position, draft_tokens.shape[1] - 1)], next_token)
    return torch.bincount(token[reached], minlength=V)


def _run_sampler(p: torch.Tensor, q: torch.Tensor | None, N: int, seed: int, always_accept: bool = False):
    """p [k+1, V], q [k, V] shared by all N samples; drafts drawn from q (or fixed tokens if q None)."""
    k, V = p.shape[0] - 1, p.shape[1]
    gen = torch.Generator().manual_seed(seed)
    if q is None:  # the target's most likely tokens, so that every position is reached often
        draft_tokens = p[:k].argmax(dim=-1).expand(N, k)
        draft_probs = None
    else:
        draft_tokens = torch.multinomial(q, N, replacement=True, generator=gen).T.contiguous()  # [N, k]
        draft_probs = q.expand(N, k, V)
    if always_accept:  # negative control: a broken verifier that accepts everything
        num_accepted = torch.full((N,), k)
        next_token = torch.multinomial(p[k], N, replacement=True, generator=gen)
    else:
        num_accepted, next_token = rejection_sample(draft_tokens, draft_probs, p.expand(N, k + 1, V), gen)
    return num_accepted, next_token, draft_tokens


CASES = {
    "temperature": SamplingParams(temperature=0.9),
    "top_k": SamplingParams(temperature=1.0, top_k=4),
    "top_p": SamplingParams(temperature=0.7, top_p=0.8),
    "min_p": SamplingParams(temperature=1.2, min_p=0.1),
}


def per_position_fit(params: SamplingParams, seed: int, N: int = 400_000) -> list[tuple[float, float, int]]:
    """(chi-square p-value, TV, samples that reached it) for each draft position and the bonus, k = 3,
    V = 10, drafts sampled from a q that mostly agrees with p. The statistic of the verifier's tests, also
    run on mutated verifiers (test_mutations)."""
    gen = torch.Generator().manual_seed(seed)
    k, V = 3, 10
    target_logits = torch.randn(k + 1, V, generator=gen) * 2
    draft_logits = target_logits[:k] + torch.randn(k, V, generator=gen)  # a draft that mostly agrees
    p = probs_from_logits(target_logits, params)
    q = probs_from_logits(draft_logits, params)
    num_accepted, next_token, drafts = _run_sampler(p, q, N, seed=1)
    assert 0 < float(num_accepted.float().mean()) < k  # both paths (rejection and bonus) exercised
    fits = []
    for pos in range(k + 1):
        counts = _emitted_counts(num_accepted, next_token, drafts, pos, V)
        fits.append((chi2_pvalue(counts, p[pos]), total_variation(counts, p[pos]), int(counts.sum())))
    return fits


@pytest.mark.parametrize("case", list(CASES))
def test_per_position_distribution(case):
    """Each draft position and the bonus token are distributed exactly as the processed target p.

    N = 400k samples, V = 10, k = 3: the chi-square test has power ~1 against TV = 0.01 at this N
    (the empirical TV's noise floor here is ~0.003). False-failure probability: ALPHA = 1e-4 per
    position, 4 positions -> < 4e-4 per case."""
    for pos, (p_value, tv, reached) in enumerate(per_position_fit(CASES[case], list(CASES).index(case))):
        assert reached > 50_000, (case, pos)  # enough samples reach every position
        assert p_value > ALPHA and tv < 0.01, (case, pos, p_value, tv)


def test_deterministic_drafts_distribution():
    """q = None (n-gram / greedy drafts): still exact. Same N, V and false-failure bound as above."""
    gen = torch.Generator().manual_seed(7)
    k, V, N = 3, 10, 400_000
    p = probs_from_logits(torch.randn(k + 1, V, generator=gen), SamplingParams(temperature=1.0))
    num_accepted, next_token, drafts = _run_sampler(p, None, N, seed=2)
    for pos in range(k + 1):
        counts = _emitted_counts(num_accepted, next_token, drafts, pos, V)
        assert counts.sum() > 5_000, pos  # every position, the bonus included, is reached often
        assert chi2_pvalue(counts, p[pos]) > ALPHA, pos


def test_negative_control_always_accept_fails():
    """A verifier that always accepts emits q, not p: the same test must reject it (p-value < ALPHA).
    With TV(p, q) ~ 0.3 and N = 400k the chance this assertion fails by bad luck is ~0."""
    gen = torch.Generator().manual_seed(3)
    k, V, N = 3, 10, 400_000
    p = probs_from_logits(torch.randn(k + 1, V, generator=gen) * 2, SamplingParams(temperature=1.0))
    q = probs_from_logits(torch.randn(k, V, generator=gen) * 2, SamplingParams(temperature=1.0))
    num_accepted, next_token, drafts = _run_sampler(p, q, N, seed=4, always_accept=True)
    counts = _emitted_counts(num_accepted, next_token, drafts, 0, V)
    assert chi2_pvalue(counts, p[0]) < ALPHA


def test_greedy_verify():
    drafts = torch.tensor([[5, 6, 7], [5, 9, 7], [1, 6, 7]])
    argmax = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    n, nxt = greedy_verify(drafts, argmax)
    assert n.tolist() == [3, 1, 0]
    assert nxt.tolist() == [8, 6, 5]


def test_k_zero_samples_from_p():
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([[0.0, 1.0, 0.0]])
    n, nxt = rejection_sample(torch.empty(1, 0, dtype=torch.long), None, p[None], gen)
    assert n.tolist() == [0] and nxt.tolist() == [1]


def test_seeded_sampler_reproduces():
    gen = torch.Generator().manual_seed(0)
    p = _random_dist(gen, (1, 4, 6)).float()
    q = _random_dist(gen, (1, 3, 6)).float()
    d = torch.tensor([[0, 1, 2]])
    a = rejection_sample(d, q, p, torch.Generator().manual_seed(9))
    b = rejection_sample(d, q, p, torch.Generator().manual_seed(9))
    assert [x.tolist() for x in a] == [x.tolist() for x in b]


def test_non_finite_draft_probability_is_rejected():
    """A NaN or inf q(x) (an fp16 draft that overflowed) is never accepted, whatever p(x) is."""
    p_x = torch.tensor([0.5, 0.5, 1.0, 0.0])
    q_x = torch.tensor([float("nan"), float("inf"), float("nan"), float("nan")])
    assert acceptance_probability(p_x, q_x).tolist() == [0.0, 0.0, 0.0, 0.0]
    V, N = 4, 2000
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25], [0.25, 0.25, 0.25, 0.25]]).expand(N, 2, V)
    q = torch.tensor([[float("nan"), 0.5, 0.25, 0.25]]).expand(N, 1, V)
    drafts = torch.zeros(N, 1, dtype=torch.long)  # token 0, whose q is NaN
    num_accepted, _ = rejection_sample(drafts, q, p, torch.Generator().manual_seed(0))
    assert int(num_accepted.sum()) == 0


def test_a_tiny_residual_is_the_recovered_distribution():
    """One-hot q on a token with p close to 1: the residual (mass ~1e-7) is exact, p is not."""
    p = torch.tensor([1 - 1.2e-7, 0.6e-7, 0.6e-7, 0.0])
    q = torch.tensor([1.0, 0.0, 0.0, 0.0])
    recovered = recovery_distribution(p, q)
    assert recovered[0] == 0 and recovered[3] == 0
    torch.testing.assert_close(recovered[1:3], torch.tensor([0.5, 0.5]))


def test_a_zero_probability_draft_is_never_accepted_even_at_u_zero(monkeypatch):
    """torch.rand draws from [0, 1): u = 0 happens. A draft token with p(x) = 0 must be rejected then too
    (acceptance is u < min(1, p/q), not u <= p/q). Deterministic: every u is 0."""
    monkeypatch.setattr(verify.torch, "rand", lambda *shape, generator=None, device=None, **kw: torch.zeros(*shape))
    p = torch.tensor([[0.0, 0.5, 0.5], [0.2, 0.4, 0.4]]).expand(10, 2, 3)
    q = torch.tensor([[0.5, 0.25, 0.25]]).expand(10, 1, 3)
    drafts = torch.zeros(10, 1, dtype=torch.long)  # token 0: q = 0.5, p = 0
    num_accepted, _ = rejection_sample(drafts, q, p, torch.Generator().manual_seed(0))
    assert int(num_accepted.sum()) == 0


def test_greedy_rows_of_a_round_are_verified_together():
    """verify_rows: greedy rows of drafts of different lengths (none too) in one call, a sampled row on its own
    between them: each row's outcome is its own verification's. The target's argmax is token 0 everywhere past the
    drafts, so a short draft padded with a token the argmax can equal would accept past its end."""
    from verispec.core.draft import Draft
    from verispec.core.rows import verify as verify_row
    from verispec.core.rows import verify_rows
    from verispec.core.sequence import TokenSequence

    logits = torch.full((5, 6), -5.0)
    logits[:, 0] = 5.0
    logits[0, 3], logits[1, 4] = 9.0, 9.0  # argmax 3, 4, 0, 0, 0
    drafts = [Draft(torch.tensor(t, dtype=torch.long), None, "ngram") for t in ([3, 4, 0, 0], [3], [], [3, 1], [3, 4])]
    params = [SamplingParams(temperature=0.0)] * 5
    params[3] = SamplingParams(temperature=1.0, seed=1)
    rows = [logits[: d.tokens.numel() + 1] for d in drafts]
    seqs = [TokenSequence([1, 2], 40, torch.device("cpu")) for _ in drafts]
    got = verify_rows(seqs, drafts, rows, params, [torch.Generator().manual_seed(1) for _ in drafts])
    alone = [verify_row(s, d, r, p, torch.Generator().manual_seed(1)) for s, d, r, p in zip(seqs, drafts, rows, params)]
    assert [(int(n), int(t)) for n, t in got] == [(int(n), int(t)) for n, t in alone]
    assert [(int(n), int(t)) for n, t in got][:3] == [(4, 0), (1, 4), (0, 3)]
