"""The registries, one per axis: BACKENDS (backend name -> loader of a Model) and DRAFTERS (drafter name -> drafter
factory and its k policy for k = 'auto')."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from verispec.backends.base import Model
from verispec.backends.lean import LeanBatch, LeanNet, lean_unsupported
from verispec.backends.linear import orient_linears
from verispec.backends.loading import configured_eos_ids, eos_token_ids, load_model, resolve_gguf
from verispec.backends.quant import quantize_model
from verispec.backends.vocab import VocabBridge, restrict_head
from verispec.decoding.policies.base import KPolicy
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.decoding.policies.tree_budget import TreeBudget
from verispec.names.errors import SpecError
from verispec.proposers import DraftModel, HybridDrafter, LookupDrafter, NgramProposer, SuffixHistory, SuffixProposer
from verispec.proposers.base import Drafter
from verispec.proposers.cross_vocab import CrossVocabDraft
from verispec.proposers.tree_draft import TreeDraftModel


def is_loaded(model: object) -> bool:
    """Whether a spec's model is an already-loaded transformers model (else a reference: name, path, GGUF file)."""
    return isinstance(model, torch.nn.Module)


@dataclass(frozen=True)
class LoadRequest:
    """What a backend loader is asked for. quant, head_ids (the reduced vocabulary's token ids) and forward
    are a transformers draft's options; ctx_size and exact_kernels are llama.cpp's."""

    model: Any
    device: torch.device
    dtype: torch.dtype
    ctx_size: int | None = None
    quant: str = "none"
    head_ids: torch.Tensor | None = None
    forward: str = "transformers"
    exact_kernels: bool = False


@dataclass(frozen=True)
class Backend:
    """A registry entry: `load(request) -> (Model, EOS ids it knows of)`; `draft_options`: it takes a draft's
    quantisation, reduced vocabulary and forward choice; `loaded_models`: it runs already-loaded transformers
    models; `available()` raises a ModelError that says how to install what it needs."""

    load: Callable[[LoadRequest], tuple[Model, list[int]]]
    draft_options: bool
    loaded_models: bool
    available: Callable[[], object] = lambda: None


def _load_hf(request: LoadRequest) -> tuple[Model, list[int]]:
    """A transformers model as a Model. One that verispec loads itself has its float32 CPU linear layers
    oriented (verispec.backends.linear); a model the caller loaded is left as it is."""
    loaded = is_loaded(request.model)
    hf_model = request.model if loaded else load_model(request.model, request.device, request.dtype)
    eos = eos_token_ids(hf_model, None)
    if request.head_ids is not None:
        restrict_head(hf_model, request.head_ids)
    if not loaded:
        orient_linears(hf_model)
    forward = request.forward
    if forward == "auto":
        forward = "lean" if lean_unsupported(hf_model) is None else "transformers"
    if forward == "lean":
        try:
            model = LeanBatch(LeanNet(hf_model.eval()))  # fuses the layers it needs into modules of its own
        except ValueError as exc:
            raise SpecError(str(exc), "draft.forward", runtime=True) from exc
        quantize_model(model.net, request.quant)
        return model, eos
    from verispec.backends.hf import HFModel  # transformers' model code: imported where a transformers model runs

    return HFModel(quantize_model(hf_model, request.quant)), eos


def _load_llamacpp(request: LoadRequest) -> tuple[Model, list[int]]:
    from verispec.backends.llamacpp import LlamaCppModel

    model = LlamaCppModel(resolve_gguf(request.model), request.device, n_ctx=request.ctx_size,
                          exact_kernels=request.exact_kernels)
    return model, [model.llm.token_eos(), *configured_eos_ids(request.model)]  # build adds the tokenizer's EOG ids


def _llama_cpp_available() -> object:
    from verispec.backends.llamacpp import import_llama_cpp

    return import_llama_cpp()


BACKENDS: dict[str, Backend] = {
    "hf": Backend(_load_hf, draft_options=True, loaded_models=True),
    "llamacpp": Backend(_load_llamacpp, draft_options=False, loaded_models=False, available=_llama_cpp_available),
}


def _ngrams(slots: int) -> LookupDrafter:
    return LookupDrafter([NgramProposer() for _ in range(slots)])


def _suffixes(slots: int) -> LookupDrafter:
    """A suffix lookup per slot, all drafting from one history of past outputs."""
    history = SuffixHistory()
    return LookupDrafter([SuffixProposer(history=history) for _ in range(slots)])


# a drafter's view of the target's vocabulary: its size, or the bridge from a draft model of another tokenizer
# (build refuses a token tree over a bridge)
Vocab = int | VocabBridge


def _model_drafter(model: Model, vocab: Vocab) -> Drafter:
    """A draft model's drafter: of the target's vocabulary, or of another one through its bridge."""
    return CrossVocabDraft(model, vocab) if isinstance(vocab, VocabBridge) else DraftModel(model, vocab)


@dataclass(frozen=True)
class DrafterEntry:
    """A registry entry: `make(draft model or None, the target's Vocab, slots) -> Drafter` (the draft model, if
    any, holds that many slots); `needs_model`: whether it drafts with a draft LM; `auto_policy(k_max) -> KPolicy`:
    the policy of k = 'auto' (token trees: their node budget and depth; chains: cost-aware k)."""

    make: Callable[[Model | None, Vocab, int], Drafter]
    needs_model: bool
    auto_policy: Callable[[int], KPolicy] = CostAwareK


DRAFTERS: dict[str, DrafterEntry] = {
    "model": DrafterEntry(lambda model, vocab, slots: _model_drafter(model, vocab), needs_model=True),
    "ngram": DrafterEntry(lambda model, vocab, slots: _ngrams(slots), needs_model=False),
    "suffix": DrafterEntry(lambda model, vocab, slots: _suffixes(slots), needs_model=False),
    "hybrid": DrafterEntry(lambda model, vocab, slots: HybridDrafter(_ngrams(slots), _model_drafter(model, vocab)),
                           needs_model=True),
    "hybrid-suffix": DrafterEntry(
        lambda model, vocab, slots: HybridDrafter(_suffixes(slots), _model_drafter(model, vocab)), needs_model=True),
    "tree": DrafterEntry(lambda model, vocab, slots: TreeDraftModel(model, vocab), needs_model=True,
                         auto_policy=lambda k_max: TreeBudget()),
}
