"""Sampling parameters and the logits -> distribution processing shared by target and draft.

Speculative decoding is lossless only if the target's distribution p and the draft's distribution q
are produced by the *same* processing, row by row, from each model's logits. Everything that turns
logits into a distribution lives here, so plain decoding, the draft and the verifier cannot drift apart.

Order of processing (as in Hugging Face's generation, after OpenAI's logit_bias, which vLLM too adds to the raw
logits first): repetition penalty over the context so far,
then temperature, top-k, top-p, min-p. Temperature 0 means greedy: the distribution is one-hot on the
argmax of the penalised logits. Around the repetition penalty, as vLLM does: first min_tokens masks the
stop ids (-inf) in rows for positions below it, after it the presence and frequency penalties subtract
from the logits per the counts of the tokens generated so far (not the prompt's). Like the presence mask,
the counts and the position are per row: row i sees the context plus the drafts before it.
"""

from __future__ import annotations

import math

import torch

from verispec.core.infill import infill_rows
from verispec.core.timing import device_tensor
from verispec.names.options import SamplingParams


def make_rng(seed: int | None, device: torch.device | str) -> torch.Generator:
    """An explicit RNG (a torch.Generator) on `device` (seed None: a fresh seed); the global RNG is never touched."""
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def rng_for(params: SamplingParams, device: torch.device | str) -> torch.Generator:
    """The RNG a generation with these params draws from, on `device`."""
    return make_rng(params.seed, device)


def _seen_rows(tokens: torch.Tensor, rows: int, vocab: int, paths: torch.Tensor | None,
               dtype: torch.dtype) -> torch.Tensor:
    """[rows, V] occurrences of `tokens` [n] that each row sees: row i the first i (paths None: a chain of
    rows), or the tokens j with paths[i, j] (a token tree's rows see their ancestors)."""
    n = tokens.numel()
    onehot = torch.zeros(n + 1, vocab, dtype=dtype, device=tokens.device)
    if n:
        onehot[torch.arange(1, n + 1, device=tokens.device), tokens] = 1
    if paths is None:
        return onehot.cumsum(0)
    return (paths.to(torch.float32) @ onehot[1:].to(torch.float32)).to(dtype)


def presence_rows(presence: torch.Tensor, tokens: torch.Tensor, paths: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row context presence for rows that each see more of `tokens`.

    presence: [V] bool, the tokens of the committed context. tokens: [n]. Returns [n+1, V] bool: row i =
    presence | tokens[:i]; with `paths` [r, n] bool (a token tree's rows): row i = presence | tokens[paths[i]].
    """
    if not tokens.numel():
        return presence.unsqueeze(0).repeat(1 if paths is None else paths.shape[0], 1)
    rows = tokens.numel() + 1 if paths is None else paths.shape[0]
    return presence.unsqueeze(0) | (_seen_rows(tokens, rows, presence.numel(), paths, torch.int32) > 0)


def count_rows(counts: torch.Tensor, tokens: torch.Tensor, paths: torch.Tensor | None = None) -> torch.Tensor:
    """Per-row token counts for rows that each see more of `tokens` (as presence_rows does for presence):
    counts [V] int, tokens [n] -> [n+1, V], row i = counts + occurrences in tokens[:i] (or in tokens[paths[i]])."""
    rows = tokens.numel() + 1 if paths is None else paths.shape[0]
    return counts.unsqueeze(0) + _seen_rows(tokens, rows, counts.numel(), paths, counts.dtype)


def token_counts(tokens: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[V] int32: how often each id occurs in tokens [n]."""
    return torch.bincount(tokens, minlength=vocab_size)[:vocab_size].to(torch.int32)


def apply_count_penalties(logits: torch.Tensor, counts: torch.Tensor, presence_penalty: float,
                          frequency_penalty: float) -> torch.Tensor:
    """OpenAI semantics: logit - presence_penalty * [count > 0] - frequency_penalty * count.
    logits: [n, V] fp32; counts: [n, V] or [V] int."""
    penalty = frequency_penalty * counts.float() + presence_penalty * (counts > 0).float()
    return logits - penalty


def apply_logit_bias(logits: torch.Tensor, bias: tuple[tuple[int, float], ...]) -> torch.Tensor:
    """OpenAI's logit_bias: each (id, value) adds value to the id's logit in every row (fp32 [n, V])."""
    ids = device_tensor([token for token, _ in bias], logits.device)
    values = device_tensor([value for _, value in bias], logits.device, torch.float32)
    return logits.index_add(-1, ids, values.expand(logits.shape[0], -1))


def mask_stop_ids(logits: torch.Tensor, params: SamplingParams, position: int) -> torch.Tensor:
    """-inf on params.stop_ids in the rows whose generated position (position + row) is below min_tokens."""
    rows = min(max(params.min_tokens - position, 0), logits.shape[0])
    if rows == 0 or not params.stop_ids:
        return logits
    ids = device_tensor(params.stop_ids, logits.device)
    logits = logits.clone()
    logits[:rows, ids] = -math.inf
    return logits


def apply_repetition_penalty(logits: torch.Tensor, presence: torch.Tensor, penalty: float) -> torch.Tensor:
    """HF semantics: logits of tokens already in the context are divided by `penalty` if positive,
    multiplied if negative. logits: [n, V] fp32; presence: [n, V] or [V] bool."""
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(presence, penalised, logits)


def _filter_top_k(logits: torch.Tensor, top_k: int) -> torch.Tensor:
    if top_k <= 0 or top_k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]  # [n, 1]
    return logits.masked_fill(logits < kth, -math.inf)


TOP_P_CANDIDATES = 256  # top-p looks at this many best tokens first, then 8x as many, then all


def _filter_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep every token whose logit is at least the cut logit, -inf elsewhere. The cut logit is the value
    at which the best-first cumulative mass first reaches top_p (the best token is always kept).

    The rule is by value, so tokens tied with the cut logit are all kept: the nucleus does not depend on
    how a sort orders equal logits, nor on which other rows share the batch. That is what makes it
    exact under speculation: a verify pass scores k + 1 rows at once, plain decoding one, and bf16
    logits tie often; a rule that kept "the first m tokens in sort order" could give a token p > 0 in
    plain decoding and p = 0 in a verify row.

    Sorting 151,936 logits costs far more than taking the best 256 on a CPU, so there the best K values
    are taken first and K grows only while their mass falls short of top_p in some row: the sorted
    values (not their order among ties) fix the cut, so any K that reaches top_p gives the same cut as
    a full sort. Elsewhere (CUDA) the sort is cheap and checking the mass would cost a device -> host
    sync, so the whole row is sorted."""
    if top_p >= 1.0:
        return logits
    vocab = logits.shape[-1]
    k = min(vocab, TOP_P_CANDIDATES) if logits.device.type == "cpu" else vocab
    log_total = torch.logsumexp(logits, dim=-1, keepdim=True)  # [n, 1]
    while True:
        best = torch.topk(logits, k, dim=-1).values  # [n, k] best first
        mass = (best - log_total).exp().cumsum(dim=-1)
        if k == vocab or bool((mass[:, -1] >= top_p).all()):
            break
        k = min(vocab, 8 * k)
    cut = (mass < top_p).sum(dim=-1, keepdim=True).clamp_max(k - 1)  # [n, 1] first index reaching top_p
    return logits.masked_fill(logits < best.gather(-1, cut), -math.inf)


def _filter_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    if min_p <= 0.0:
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p * probs.max(dim=-1, keepdim=True).values
    return logits.masked_fill(probs < threshold, -math.inf)


def process_logits(
    logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None = None,
    counts: torch.Tensor | None = None, position: int = 0,
) -> torch.Tensor:
    """Penalised, filtered logits in fp32 ([n, V] in, [n, V] out). Temperature is applied only when > 0.
    `counts`: the generated tokens' counts per row (presence/frequency penalties); `position`: the generated
    position of row 0 (min_tokens masks the stop ids in rows below it)."""
    logits = logits.float()
    if params.logit_bias:
        logits = apply_logit_bias(logits, params.logit_bias)
    if params.masks_stops(position):
        logits = mask_stop_ids(logits, params, position)
    if params.penalised:
        assert presence is not None, "repetition penalty needs the context presence mask"
        logits = apply_repetition_penalty(logits, presence, params.repetition_penalty)
    if params.counted:
        assert counts is not None, "presence/frequency penalties need the generated tokens' counts"
        logits = apply_count_penalties(logits, counts, params.presence_penalty, params.frequency_penalty)
    if params.greedy:
        return logits
    if params.temperature != 1.0:
        logits = logits / params.temperature
    logits = _filter_top_k(logits, params.top_k)
    logits = _filter_top_p(logits, params.top_p)
    logits = _filter_min_p(logits, params.min_p)
    return logits


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dimension ([n, V] -> [n], the first index on ties, as torch.argmax), on
    logits' device. On the CPU through numpy, whose argmax over a large vocabulary is an order of magnitude
    faster than torch's CPU kernel. Only for float32 (what process_logits returns): numpy has no bfloat16."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def probs_from_logits(
    logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None = None,
    counts: torch.Tensor | None = None, position: int = 0,
) -> torch.Tensor:
    """The processed distribution, fp32 [n, V]. Greedy gives the one-hot of the argmax; the infill sampler, where
    asked for, transforms the filtered distribution (verispec.core.infill)."""
    processed = process_logits(logits, params, presence, counts, position)
    if params.greedy:
        probs = torch.zeros_like(processed)
        return probs.scatter_(-1, greedy_tokens(processed).unsqueeze(-1), 1.0)
    if params.infilling:
        if params.vocabulary is None:
            raise ValueError("the infill sampler needs the model's token pieces (params.with_vocabulary)")
        return infill_rows(processed.softmax(dim=-1), params.vocabulary)
    return processed.softmax(dim=-1)


def sample(probs: torch.Tensor, rng: torch.Generator) -> torch.Tensor:
    """One token per row of probs [n, V] -> [n], by inverting the cumulative distribution in float64
    (over a large vocabulary an order of magnitude faster than torch.multinomial). A token with probability 0
    is never drawn: its cumulative value equals its predecessor's, and the first value above u is taken."""
    cdf = probs.double().cumsum(dim=-1)  # [n, V]
    u = torch.rand(probs.shape[0], 1, generator=rng, device=probs.device, dtype=torch.float64)
    index = torch.searchsorted(cdf, u * cdf[:, -1:], right=True)  # first cdf > u * total
    return index.clamp_max(probs.shape[-1] - 1).squeeze(-1)
