"""Hugging Face transformers backend: any AutoModelForCausalLM with a DynamicCache cropped in place."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel

from verispec.backends.base import check_rows


class HFModel:
    """The Model protocol over a transformers causal LM: one slot (transformers' forward runs one sequence here;
    the lean path batches). Rollback crops the cache (a view, no copy)."""

    slots = 1

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        head = model.get_output_embeddings()  # a SubsetHead (reduced draft vocabulary) says its full width
        self.vocab_size = int(getattr(head, "vocab_size", None) or head.weight.shape[0])
        self.max_length = int(getattr(model.config, "max_position_embeddings", None) or 1 << 31)
        self.cache = DynamicCache(config=model.config)
        self.lengths = [0]

    @torch.inference_mode()
    def forward_rows(self, slots: list[int], feeds: list[torch.Tensor], last_only: bool = False,
                     logits_for: list[int] | None = None) -> list[torch.Tensor]:
        """feeds[0] [n] long on self.device -> the logits of its last logits_for[0] tokens [logits_for[0], V] (see
        Model)."""
        kept = check_rows(self, slots, feeds, last_only, logits_for)[0]
        tokens, start = feeds[0], self.lengths[0]
        n = tokens.numel()
        positions = torch.arange(start, start + n, device=self.device).unsqueeze(0)
        out = self.model(input_ids=tokens.view(1, n), position_ids=positions, cache=self.cache, use_cache=True,
                         logits_to_keep=max(kept, 1))
        self.lengths[0] = start + n
        return [out.logits[0, out.logits.shape[1] - kept :]]

    def rollback(self, slot: int, length: int) -> None:
        held = self.lengths[slot]
        if not 0 <= length <= held:
            raise ValueError(f"cannot roll back to {length}: cache holds {held}")
        if length < held:
            self.cache.crop(length - held)
            self.lengths[0] = length

    def swap(self, a: int, b: int) -> None:
        if a != b:
            raise ValueError("a transformers model holds one slot")

    def copy(self, src: int, dst: int, length: int) -> None:
        raise ValueError("a transformers model holds one slot: there is no other slot to copy")

    def reset(self, slot: int | None = None) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self.lengths[0] = 0
