"""The rows that feed verification, in one place: the target's processed rows for a chain's positions (argmax ids
or probabilities, every sampling option and penalty applied row by row, each row seeing the drafts before it), the
rejection sampler over them, the commit of a round's tokens (the round's one device -> host transfer), and the
log-probabilities reported for committed tokens; and a token tree's rows, each node's row seeing its own path.
The draft model processes its logits into q with the same `penalty_state` and `processed_rows`.
A round moves every row's outcome to the host in one transfer (`outcome`, then `commit` on the host values)."""

from __future__ import annotations

import math

import torch

from verispec.core.draft import Draft
from verispec.core.sampling import (
    SamplingParams,
    count_rows,
    greedy_tokens,
    presence_rows,
    probs_from_logits,
    process_logits,
    token_counts,
)
from verispec.core.sequence import TokenSequence
from verispec.core.timing import device_tensor
from verispec.core.tree import TokenTree
from verispec.core.verify import greedy_verify, rejection_sample

# per generated token: (its logprob, [(id, logprob) of the most likely tokens]) under the target's processed
# distribution; -inf (a token the filters removed) is reported as LOGPROB_FLOOR, JSON having no infinity
TokenLogprob = tuple[float, list[tuple[int, float]]]
LOGPROB_FLOOR = -9999.0


def penalty_state(
    seq: TokenSequence, params: SamplingParams, vocab_size: int
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """What the penalties read of a sequence: which tokens occur in it [V] bool (the repetition penalty) and how
    often each occurs among its generated tokens [V] int (the presence and frequency penalties); None where no
    penalty of `params` needs it. The draft and the target start every row from this."""
    presence = seq.presence(vocab_size) if params.penalised else None
    counts = token_counts(seq.device_ids[seq.prompt_length :], vocab_size) if params.counted else None
    return presence, counts


def penalty_rows(
    presence: torch.Tensor | None, counts: torch.Tensor | None, tokens: torch.Tensor, paths: torch.Tensor | None = None
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The penalty state [V] per row of rows that each see more of `tokens` [n] (see presence_rows and
    count_rows): [n+1, V] each, or one row per path with `paths`; None stays None."""
    return (None if presence is None else presence_rows(presence, tokens, paths),
            None if counts is None else count_rows(counts, tokens, paths))


def processed_rows(
    logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None, counts: torch.Tensor | None,
    position: int,
) -> torch.Tensor:
    """Logits [n, V] under a request's processing (see process_logits): argmax ids [n] (greedy) or probs
    [n, V]. The target's rows for verification and the draft's q come from this one definition."""
    if params.greedy:
        return greedy_tokens(process_logits(logits, params, presence, counts, position))
    return probs_from_logits(logits, params, presence, counts, position)


def target_rows(
    logits: torch.Tensor, draft_tokens: torch.Tensor, params: SamplingParams, seq: TokenSequence
) -> torch.Tensor:
    """Processed target rows [k+1, V]: argmax ids [k+1] (greedy) or probs p [k+1, V]."""
    presence, counts = penalty_rows(*penalty_state(seq, params, logits.shape[-1]), draft_tokens)
    return processed_rows(logits, params, presence, counts, seq.new_tokens)


def logprob_rows(
    logits: torch.Tensor, draft_tokens: torch.Tensor, params: SamplingParams, seq: TokenSequence
) -> torch.Tensor:
    """[k+1, V] log-probabilities of the target's processed distribution (greedy: of its penalised logits,
    at temperature 1, since the one-hot would say nothing)."""
    presence, counts = penalty_rows(*penalty_state(seq, params, logits.shape[-1]), draft_tokens)
    return log_rows(logits, params, presence, counts, seq.new_tokens)


def log_rows(logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None,
             counts: torch.Tensor | None, position: int) -> torch.Tensor:
    """Log-probabilities [n, V] of the processed distribution (greedy: of the penalised logits at temperature 1;
    with the infill sampler, of its transformed distribution)."""
    if params.infilling:
        return probs_from_logits(logits, params, presence, counts, position).log()
    return process_logits(logits, params, presence, counts, position).log_softmax(dim=-1)


def verify(
    seq: TokenSequence, draft: Draft, logits: torch.Tensor, params: SamplingParams, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's verification of its draft against the target's logits [k+1, V] for the positions after
    seq and after each draft: (accepted count [1], the recovered or bonus token [1]), on the device."""
    rows = target_rows(logits, draft.tokens, params, seq)
    if params.greedy:
        return greedy_verify(draft.tokens[None], rows[None])
    return rejection_sample(draft.tokens[None], None if draft.probs is None else draft.probs[None], rows[None], gen)


def verify_rows(
    seqs: list[TokenSequence], drafts: list[Draft], logits: list[torch.Tensor], params: list[SamplingParams],
    gens: list[torch.Generator],
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """`verify` for every row of a round: each sampled row on its own (its own RNG), the greedy rows in one
    batched call (their drafts padded with -1, which no argmax equals, so none accepts past its own draft)."""
    out = [None if p.greedy else verify(seq, draft, row_logits, p, gen)
           for seq, draft, row_logits, p, gen in zip(seqs, drafts, logits, params, gens)]
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        argmax = [target_rows(logits[i], drafts[i].tokens, params[i], seqs[i]) for i in greedy]
        pad = torch.nn.utils.rnn.pad_sequence
        n, nxt = greedy_verify(pad([drafts[i].tokens for i in greedy], batch_first=True, padding_value=-1),
                               pad(argmax, batch_first=True))
        for j, i in enumerate(greedy):
            out[i] = (n[j : j + 1], nxt[j : j + 1])
    return out


def outcome(n: torch.Tensor, nxt: torch.Tensor, draft: Draft) -> torch.Tensor:
    """A verified row's outcome as one tensor for the round's one device -> host transfer: [accepted, the target's
    token, the drafts...] (`commit` takes it back on the host)."""
    return torch.cat([n, nxt, draft.tokens])


def commit(
    seq: TokenSequence, draft: Draft, host: list[int], nxt: torch.Tensor, logits: torch.Tensor,
    params: SamplingParams, logprobs: list[TokenLogprob] | None, top_logprobs: int,
) -> tuple[list[int], int]:
    """Append the accepted drafts and the target's token to seq, from the row's `outcome` on the host (`nxt` the
    target's token still on the device); with `logprobs`, append each committed token's TokenLogprob. Returns
    (committed ids, accepted count)."""
    accepted = host[0]
    committed = host[2 : 2 + accepted] + [host[1]]
    if logprobs is not None:
        logp = logprob_rows(logits, draft.tokens, params, seq)
        logprobs.extend(token_logprobs(logp[: accepted + 1], committed, top_logprobs))
    seq.extend(committed, torch.cat([draft.tokens[:accepted], nxt]))
    return committed, accepted


def token_logprobs(logp: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """TokenLogprob for each row of logp [n, V] and its chosen token."""
    rows = torch.arange(len(tokens), device=logp.device)
    chosen = logp[rows, torch.tensor(tokens, device=logp.device)].tolist()
    best = torch.topk(logp, min(top, logp.shape[-1]), dim=-1) if top else None
    entries = []
    for i, value in enumerate(chosen):
        alts = list(zip(best.indices[i].tolist(), best.values[i].tolist())) if best is not None else []
        entries.append((_finite(value), [(a, _finite(v)) for a, v in alts]))
    return entries


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else LOGPROB_FLOOR


# -- a token tree's rows ------------------------------------------------------------------------------


def tree_rows(logits: torch.Tensor, tree: TokenTree, params: SamplingParams, seq: TokenSequence,
              log: bool = False) -> torch.Tensor:
    """The target's processed rows for the root and every node ([m + 1, V] logits in): argmax ids [m + 1]
    (greedy), probs [m + 1, V], or with `log` log-probabilities [m + 1, V] (greedy: of the penalised logits at
    temperature 1). Row i + 1 sees node i's path for the penalties and its depth for min_tokens."""
    paths = tree.paths()  # row 0, the root's, sees no node
    presence, counts = penalty_rows(*penalty_state(seq, params, logits.shape[-1]), tree.tokens, paths)
    position = seq.new_tokens
    if not params.masks_stops(position):
        return _process(logits, params, presence, counts, position, log)
    depths = device_tensor([0, *tree.depths], logits.device)  # min_tokens masks by depth: a group each
    out = None
    for d in range(tree.depth + 1):
        rows = (depths == d).nonzero().squeeze(-1)
        part = _process(logits[rows], params, _take(presence, rows), _take(counts, rows), position + d, log)
        if out is None:
            out = part.new_empty((logits.shape[0], *part.shape[1:]))
        out[rows] = part
    return out


def _take(rows: torch.Tensor | None, index: torch.Tensor) -> torch.Tensor | None:
    return None if rows is None else rows[index]


def _process(logits: torch.Tensor, params: SamplingParams, presence: torch.Tensor | None,
             counts: torch.Tensor | None, position: int, log: bool) -> torch.Tensor:
    """Rows that all sit at generated position `position` or later: min_tokens masks the stop ids in all of
    them or in none (never by row order, as a chain's rows are)."""
    if params.masks_stops(position):
        logits = logits.float().clone()
        logits[:, list(params.stop_ids)] = float("-inf")
    position = params.unmasked_from(position)
    if log:
        return log_rows(logits, params, presence, counts, position)
    return processed_rows(logits, params, presence, counts, position)
