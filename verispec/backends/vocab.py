"""A reduced-vocabulary LM head for the draft model (`--draft-vocab N`).

The draft scores only N frequent tokens; every other token gets logit -inf, so q = 0 there. Verification
stays exact: a token the draft cannot propose is still reachable through the recovered distribution
norm(max(0, p - q)), which equals p wherever q = 0. Only acceptance can drop (when the target's choice lies
outside the subset), while the draft's LM head, 151,936 x 896 for the 0.5B, shrinks to N x 896.

Ranking: a byte-level BPE vocabulary numbers its tokens in merge order, and merges are learned most frequent
first, so a lower id means a more frequent string in the tokenizer's training corpus. The subset is every
special / added token (EOS, chat-template markers) plus the lowest N ids, grown to a multiple of 64 (the int4
kernel packs rows in 16s).
"""

from __future__ import annotations

import torch
from torch import nn

ROW_MULTIPLE = 64


def frequent_tokens(tokenizer, n: int, vocab_size: int) -> torch.Tensor:
    """[~n] sorted token ids: the tokenizer's special and added tokens, then ids in merge order."""
    if n <= 0:
        raise ValueError(f"the reduced draft vocabulary must be a positive number of tokens, got {n}")
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", [])}
    special |= {int(i) for i in getattr(tokenizer, "added_tokens_decoder", {})}
    special = {i for i in special if 0 <= i < vocab_size}
    size = min(vocab_size, -(-max(n, len(special)) // ROW_MULTIPLE) * ROW_MULTIPLE)
    ranked = [i for i in range(vocab_size) if i not in special][: size - len(special)]
    return torch.tensor(sorted(special | set(ranked)), dtype=torch.long)


class SubsetHead(nn.Module):
    """logits[..., ids] = x @ W[ids].T (+ b); -inf everywhere else. `proj` is an ordinary nn.Linear, so
    draft quantisation applies to it like to any other layer."""

    def __init__(self, head: nn.Linear, ids: torch.Tensor) -> None:
        super().__init__()
        weight = head.weight.detach()
        self.vocab_size = int(weight.shape[0])
        ids = ids.to(weight.device)
        self.proj = nn.Linear(weight.shape[1], ids.numel(), bias=head.bias is not None,
                              device=weight.device, dtype=weight.dtype)
        with torch.no_grad():
            self.proj.weight.copy_(weight[ids])
            if head.bias is not None:
                self.proj.bias.copy_(head.bias.detach()[ids])
        self.register_buffer("ids", ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        sub = self.proj(x)  # [..., N]
        out = sub.new_full((*sub.shape[:-1], self.vocab_size), float("-inf"))
        return out.index_copy_(-1, self.ids, sub)  # [..., V]


def restrict_head(model: nn.Module, ids: torch.Tensor) -> nn.Module:
    """Swap the model's output projection for a SubsetHead over `ids`, in place."""
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear):
        raise ValueError(f"cannot restrict an LM head of type {type(head).__name__}")
    model.set_output_embeddings(SubsetHead(head, ids))
    return model
