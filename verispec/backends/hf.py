"""Hugging Face transformers backend: any AutoModelForCausalLM with a DynamicCache cropped in place."""

from __future__ import annotations

import torch
from transformers import DynamicCache, PreTrainedModel


class HFModel:
    """Wraps a transformers causal LM for one sequence. Rollback crops the cache (a view, no copy)."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model.eval()
        self.device = next(model.parameters()).device
        head = model.get_output_embeddings()  # a SubsetHead (reduced draft vocabulary) says its full width
        self.vocab_size = int(getattr(head, "vocab_size", None) or head.weight.shape[0])
        self.max_length = int(getattr(model.config, "max_position_embeddings", None) or 1 << 31)
        self.cache = DynamicCache(config=model.config)
        self._length = 0

    @property
    def length(self) -> int:
        return self._length

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """tokens: [n] long on self.device -> logits [n, V] (or [1, V] with last_only)."""
        n = tokens.numel()
        if self._length + n > self.max_length:
            raise ValueError(f"sequence of {self._length + n} tokens exceeds the model's context of {self.max_length}")
        positions = torch.arange(self._length, self._length + n, device=self.device).unsqueeze(0)
        out = self.model(
            input_ids=tokens.view(1, n),
            position_ids=positions,
            cache=self.cache,
            use_cache=True,
            logits_to_keep=1 if last_only else 0,
        )
        self._length += n
        return out.logits[0]

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._length}")
        if length < self._length:
            self.cache.crop(length - self._length)
            self._length = length

    def reset(self) -> None:
        self.cache = DynamicCache(config=self.model.config)
        self._length = 0
