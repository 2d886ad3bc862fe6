"""Loading each model once, however many pipelines use it: `ModelStore` (warmed up on load), and the lean path's
net per transformers model."""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from verispec.assembly.registry import BACKENDS, LoadRequest, is_loaded
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.backends.base import Model, Sequence
from verispec.backends.lean import LeanBatch, LeanNet
from verispec.backends.loading import eog_token_ids, load_model, load_tokenizer
from verispec.backends.vocab import VocabBridge, frequent_tokens
from verispec.names.k import K_MAX


def _model_key(model: object) -> object:
    return ("loaded", id(model)) if is_loaded(model) else model


WARM_UP_TOKENS = K_MAX + 1  # the widest verify pass at the default k_max


def warm_up(model: Model) -> None:
    """Run a model's first forwards now, then empty its cache. A first forward can cost several later ones
    (weights paged in, buffers allocated, kernels chosen per batch shape), and the cost-aware k policy learns
    the costs of drafting and verifying from the first rounds: one slow first measurement can keep a draft
    off for a whole process. One pass over a verify-sized batch and one single-token step; then `reset`, so
    the outputs are those of a model never run (the cache is all a Model carries between forwards)."""
    n = min(WARM_UP_TOKENS, model.max_length)
    tokens = torch.zeros(n, dtype=torch.long, device=model.device)  # token 0: in every vocabulary
    sequence = Sequence(model)
    sequence.forward(tokens)
    sequence.forward(tokens[:1], last_only=True)
    model.reset()


class ModelStore:
    """Loaded tokenizers and models, keyed by what determines them (the reference, backend, device, dtype,
    and for a draft its quantisation, vocabulary and forward), so that pipelines built from specs naming the
    same model load it once. A target and a draft are never shared with each other, even when the specs
    name the same model: one generation uses both caches at once.

    Pipelines that share a loaded model share its KV caches, and each engine believes its caches hold
    what it left there. So at most one of them generates at a time, and each is reset
    (`pipeline.engine.reset()`) before it generates after another one used the shared model."""

    def __init__(self) -> None:
        self._items: dict[tuple, object] = {}
        self.seconds: dict[tuple, float] = {}  # how long each entry took to load (and warm up)

    def _get(self, key: tuple, make: Callable[[], object]) -> object:
        if key not in self._items:
            t0 = time.perf_counter()
            self._items[key] = make()
            self.seconds[key] = time.perf_counter() - t0
        return self._items[key]

    def tokenizer(self, ref: str):
        """The tokenizer of a model reference."""
        return self._get(("tokenizer", ref), lambda: load_tokenizer(ref))

    def end_tokens(self, ref: str) -> list[int]:
        """The ids that end generation for a model reference's tokenizer (see verispec.backends.loading.eog_token_ids)."""
        return self._get(("end tokens", ref), lambda: eog_token_ids(self.tokenizer(ref)))

    def target(self, spec: TargetSpec, dtype: torch.dtype) -> tuple[Model, list[int]]:
        """(Model, EOS ids) for a resolved target spec, warmed up."""
        device = torch.device(spec.device)
        key = ("target", _model_key(spec.model), spec.backend, spec.device, dtype, spec.ctx_size, spec.exact_kernels)

        def make() -> tuple[Model, list[int]]:
            request = LoadRequest(spec.model, device, dtype, spec.ctx_size, exact_kernels=spec.exact_kernels)
            model, eos = BACKENDS[spec.backend].load(request)
            warm_up(model)
            return model, eos

        return self._get(key, make)

    def draft(self, spec: DraftSpec, device: torch.device, dtype: torch.dtype, tokenizer, vocab_size: int) -> Model:
        """The draft Model for a resolved draft spec, on the target's device and dtype, warmed up; `tokenizer`
        and `vocab_size` (the draft's) pick a reduced vocabulary's tokens."""
        key = ("draft", _model_key(spec.model), spec.backend, str(device), dtype, spec.quant, spec.vocab,
               spec.forward, spec.ctx_size)

        def make() -> Model:
            head_ids = frequent_tokens(tokenizer, spec.vocab, vocab_size) if spec.vocab else None
            request = LoadRequest(spec.model, device, dtype, spec.ctx_size, spec.quant, head_ids, spec.forward)
            model = BACKENDS[spec.backend].load(request)[0]
            warm_up(model)
            return model

        return self._get(key, make)

    def bridge(self, target_tokenizer, draft_tokenizer, target_vocab: int, draft_vocab: int,
               device: torch.device) -> VocabBridge:
        """The VocabBridge between a target's and a draft's tokenizers, on `device`."""
        key = ("bridge", id(target_tokenizer), id(draft_tokenizer), target_vocab, draft_vocab, str(device))
        return self._get(key, lambda: VocabBridge(target_tokenizer, draft_tokenizer, target_vocab, draft_vocab,
                                                  device))

    def transformers_model(self, ref: str, device: torch.device, dtype: torch.dtype):
        """A plain transformers model (no quantisation, full head, its own forward), e.g. for a reference
        implementation to run."""
        return self._get(("transformers", ref, str(device), dtype), lambda: load_model(ref, device, dtype))


_LEAN_NETS: "weakref.WeakKeyDictionary[Any, LeanNet]" = weakref.WeakKeyDictionary()  # transformers model -> its net


def lean_net(model: Model) -> LeanNet:
    """The LeanNet of a transformers-backed Model, built once per transformers model: it holds fused copies of
    the q/k/v and gate/up weights (about 60% of the model's weights more in memory)."""
    if isinstance(model, LeanBatch):
        return model.net
    if model.model not in _LEAN_NETS:
        _LEAN_NETS[model.model] = LeanNet(model.model)
    return _LEAN_NETS[model.model]
