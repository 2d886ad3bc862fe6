"""The draft's vocabulary: a reduced-vocabulary LM head (`--draft-vocab N`), and the bridge to a target of
another tokenizer (`VocabBridge`).

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


def same_vocabulary(target_tokenizer, draft_tokenizer) -> bool:
    """Whether two transformers tokenizers hold the same tokens under the same ids (else a draft needs a bridge)."""
    return target_tokenizer.get_vocab() == draft_tokenizer.get_vocab()


def _padded(table: list[bytes], size: int) -> list[bytes]:
    """A tokenizer's bytes per id sized to its model's logits: ids past them dropped (the model never produces
    them), ids the tokenizer lacks b""."""
    return table[:size] + [b""] * (size - len(table))


class VocabBridge:
    """How a draft model of another vocabulary meets the target: the tokens both hold (verispec.catalog.vocab),
    as index tensors on the device, and each side's bytes per token and text encoder. `to_target` turns draft
    logits into target-vocabulary logits over the shared tokens (-inf elsewhere: q = 0 there); `draft_of` maps a
    shared target token back to the draft's id. Needs fast (tokenizers-backed) tokenizers."""

    def __init__(self, target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int,
                 device: torch.device) -> None:
        from verispec.catalog.vocab import byte_tokens, shared_tokens, token_bytes, without_prefix_space

        target, draft = (getattr(t, "backend_tokenizer", None) for t in (target_tokenizer, draft_tokenizer))
        if target is None or draft is None:
            raise ValueError("a draft of another vocabulary needs fast (tokenizers-backed) tokenizers on both sides")
        self.shared = shared_tokens(target, draft)
        pairs = [(t, d) for t, d in self.shared.pairs if t < target_vocab and d < draft_vocab]
        if not pairs:
            raise ValueError("the draft's and the target's vocabularies have no token in common")
        # each id's bytes, b"" for the ids a model's logits have beyond its tokenizer
        self.target_bytes = _padded(token_bytes(target), target_vocab)
        self.draft_bytes = _padded(token_bytes(draft), draft_vocab)
        # running text (a draft's continuation, the text after a round) is encoded without a prepended space
        self._target, self._draft, self._draft_start = without_prefix_space(target), without_prefix_space(draft), draft
        self.draft_speaks = torch.tensor([bool(b) for b in self.draft_bytes], device=device)  # [Vd]: ids with text
        self.target_vocab = target_vocab
        t_ids, d_ids = zip(*pairs)
        self.target_ids = torch.tensor(t_ids, dtype=torch.long, device=device)  # [S]
        self.draft_ids = torch.tensor(d_ids, dtype=torch.long, device=device)  # [S], pairwise with target_ids
        self.draft_of = dict(pairs)  # shared target id -> draft id
        self.target_byte_ids, self.draft_byte_ids = byte_tokens(self.target_bytes), byte_tokens(self.draft_bytes)
        self.draft_index = torch.zeros(target_vocab, dtype=torch.long, device=device)  # the same, on the device
        self.draft_index[self.target_ids] = self.draft_ids

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [n, Vd] -> [n, target_vocab]: each shared token's draft logit at its target id, -inf
        elsewhere."""
        out = logits.new_full((*logits.shape[:-1], self.target_vocab), float("-inf"))
        return out.index_copy_(-1, self.target_ids, logits.index_select(-1, self.draft_ids))

    def to_draft(self, tokens: torch.Tensor) -> torch.Tensor:
        """Shared target tokens [n] -> the draft's ids for them [n] (on the device)."""
        return self.draft_index[tokens]

    def encode_target(self, text: str) -> list[int]:
        """Running text -> target token ids (special-token strings become their tokens, as in a chat template)."""
        return self._target.encode(text, add_special_tokens=False).ids

    def encode_draft(self, text: str, start: bool = False):
        """Text -> the draft's encoding of it (`ids`, and `offsets`: each token's span in characters); `start`: the
        text opens a sequence (a space prepended where the tokenizer does so), else it continues running text."""
        return (self._draft_start if start else self._draft).encode(text, add_special_tokens=False)
