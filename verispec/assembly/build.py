"""Build a pipeline from specifications: the one place front ends load models.

A pipeline is a target model, an optional drafter and k (draft tokens per round). `TargetSpec` and `DraftSpec`
(verispec.assembly.specs) say what to load and how; `resolve` (verispec.assembly.resolve) turns their "auto"
choices into concrete ones, `ModelStore` (verispec.assembly.store) loads each model once, the registries
(verispec.assembly.registry) map names to loaders and drafters, and `build` puts one pipeline together. `load` is
the public entry point over all of it.
"""

from __future__ import annotations

import functools
import time
import warnings
from dataclasses import replace
from typing import Any

import torch

from verispec.assembly.registry import BACKENDS, DRAFTERS, is_loaded
from verispec.assembly.resolve import check_exact_kernels, choose_dtype, default_refs, resolve, resolve_target_backend
from verispec.assembly.specs import DraftSpec, TargetSpec, check_k
from verispec.assembly.store import ModelStore, lean_net
from verispec.backends import is_hf_model
from verispec.backends.base import Model
from verispec.backends.lean import LeanBatch, lean_unsupported
from verispec.backends.loading import DTYPES, eog_token_ids
from verispec.backends.vocab import same_vocabulary
from verispec.catalog.vocab import token_bytes
from verispec.core.grammar import Grammars
from verispec.core.infill import TokenPieces
from verispec.decoding.engine import SpeculativeEngine
from verispec.names.drafters import BACKEND_NAMES
from verispec.names.errors import SpecError
from verispec.names.k import K_MAX, own_default, unasked_k
from verispec.pipeline.pipeline import Pipeline


def _dtype(target: TargetSpec) -> torch.dtype:
    """The torch dtype of a resolved target's weights (a loaded model keeps its own)."""
    if is_loaded(target.model):
        return next(target.model.parameters()).dtype
    return DTYPES[target.dtype]


def _forward_name(model: Model | None, backend: str | None) -> str:
    if model is None or backend != "hf":
        return "none"
    return "lean" if isinstance(model, LeanBatch) else "transformers"


def build(target: TargetSpec, draft: DraftSpec | None = None, k: int | str | None = None, *, k_max: int = K_MAX,
          store: ModelStore | None = None) -> Pipeline:
    """A pipeline for `target` drafted by `draft` (None: plain decoding) with k draft tokens per round (an
    integer >= 0, 'auto', or None: the k verispec.names.k.unasked_k gives: 0 without a draft, 'auto' for a
    tree, DEFAULTS' k for the backend's default drafter or its own pair, else default_k). Models come from `store`
    (a fresh one when None): pipelines built on one store share the models their specs have in common (see
    ModelStore for the reset rule). A draft model of another tokenizer drafts through a VocabBridge
    (verispec.proposers.cross_vocab), with a warning when the two share too few tokens for drafting to help.
    Generation ends at the configured EOS ids and at every token llama.cpp treats as the end of generation, on
    every backend alike."""
    if k is not None:
        check_k(k)
    backend, reason = resolve_target_backend(target)
    dtype_auto = target.dtype is None and not is_loaded(target.model)
    default_pair = draft is not None and draft.drafter == "auto"
    target, draft, device = resolve(replace(target, backend=backend), draft)
    has_model = draft is not None and draft.model is not None
    draft_backend = draft.backend if has_model else None
    if dtype_auto and "hf" in (target.backend, draft_backend):  # a model loaded through transformers
        reason += "; " + choose_dtype(device)[1]
    if k is None:
        kind, draft_ref = (draft.drafter, draft.model) if draft is not None else (None, None)
        k = unasked_k(target.backend, kind, draft_ref, draft_backend, named=not default_pair)
        if own_default(target.backend, kind, draft_ref, draft_backend, named=not default_pair):
            name = BACKEND_NAMES.get(target.backend, target.backend)
            reason += f"; drafter {kind} and k={k}: the {name} defaults"
    check_exact_kernels(target, k)
    tree = draft is not None and draft.drafter == "tree"
    if tree and "llamacpp" in (target.backend, draft_backend):
        raise SpecError("token trees run on the transformers backend (llama.cpp verifies chains only here)",
                        "draft.drafter", (("target.backend", "hf"),))
    store = store if store is not None else ModelStore()
    for name in dict.fromkeys((target.backend, draft_backend)):
        if name is not None:
            BACKENDS[name].available()  # say how to install it before loading anything
    dtype = _dtype(target)
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    tokenizer = target.tokenizer if target.tokenizer is not None else store.tokenizer(target.model)
    draft_tokenizer = store.tokenizer(draft.model) if has_model and not is_loaded(draft.model) else tokenizer
    cross = not same_vocabulary(tokenizer, draft_tokenizer)  # a draft of another tokenizer
    if cross and tree:
        raise SpecError("token trees need a draft of the target's vocabulary", "draft.drafter")
    times["tokenizers"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    target_model, eos = store.target(target, dtype)
    times["target"] = time.perf_counter() - t0
    draft_model = bridge = None
    if has_model:
        t0 = time.perf_counter()
        draft_model = store.draft(draft, device, dtype, draft_tokenizer,
                                  len(draft_tokenizer) if cross else target_model.vocab_size)
        times["draft"] = time.perf_counter() - t0
    if cross:
        bridge = store.bridge(tokenizer, draft_tokenizer, target_model.vocab_size, draft_model.vocab_size, device)
        warning = bridge.shared.warning()
        if warning is not None:
            warnings.warn(warning, stacklevel=2)
    if tree:
        target_model, draft_model = _tree_models(target_model, draft_model)
    vocab = bridge if bridge is not None else target_model.vocab_size
    drafter = None if draft is None else DRAFTERS[draft.drafter].make(draft_model, vocab, 1)
    end = eog_token_ids(tokenizer) if target.tokenizer is not None else store.end_tokens(target.model)
    eos = sorted({*eos, *end})
    policy = None if draft is None else DRAFTERS[draft.drafter].auto_policy(k_max)
    engine = SpeculativeEngine(target_model, drafter, eos, k, auto_policy=policy,
                               max_length=None if draft_model is None or cross else draft_model.max_length,
                               vocabulary=token_pieces(tokenizer, eos, target_model.vocab_size),
                               grammars=grammars_for(tokenizer, eos, target_model.vocab_size))
    kernels = None
    if "llamacpp" in (target.backend, draft_backend):
        from verispec.backends.llamacpp import kernels as llama_kernels

        kernels = llama_kernels().describe(getattr(target_model, "weight_types", None))
    pipe = Pipeline(engine, tokenizer, target, draft, device, draft_model, _forward_name(draft_model, draft_backend),
                    times, reason, kernels, vocab_bridge=bridge)
    batch_reason = batch_unsupported(pipe)
    return replace(pipe, batch_reason=batch_reason,
                   make_batch=None if batch_reason else functools.partial(batch_engine, pipe))


def _tree_models(target: Model, draft: Model) -> tuple[Model, Model]:
    """The target and draft of a tree drafter: both verify trees on the lean path (the target on a LeanNet of
    its transformers model, which holds fused copies of some weights: see lean_net)."""
    if not isinstance(draft, LeanBatch):
        raise SpecError("token trees need the draft on the lean path (draft forward lean, an architecture it runs)",
                        "draft.forward", runtime=True)
    if isinstance(target, LeanBatch):
        return target, draft
    reason = lean_unsupported(target.model)
    if reason is not None:
        raise SpecError(f"token trees run on the lean path, which cannot run {reason}", "draft.drafter", runtime=True)
    lean = LeanBatch(lean_net(target))
    lean.max_length = target.max_length
    return lean, draft


def batch_unsupported(pipe: Pipeline) -> str | None:
    """Why `pipe` cannot decode a batch, or None when it can: every model must hold several sequences (llama.cpp
    and the lean path do; transformers' own forward holds one)."""
    if pipe.drafter == "tree":
        return "token trees do not batch (each tree is verified in a pass of its own)"
    models = [pipe.engine.target] + ([pipe.draft_model] if pipe.draft_model is not None else [])
    if pipe.draft_model is not None and pipe.draft_forward == "transformers" and pipe.draft_quant != "none":
        return "a quantised draft batches on the lean path only (draft forward lean)"
    for model in models:
        if is_hf_model(model):
            reason = lean_unsupported(model.model)
            if reason is not None:
                return f"batched decoding runs on the lean path, which cannot run {reason}"
    return None


def _with_slots(model: Model, slots: int) -> Model:
    """A Model of `slots` sequences on `model`'s weights (caches of its own): llama.cpp opens another context, the
    lean path another cache; a transformers model runs on its lean net."""
    if is_hf_model(model):
        lean = LeanBatch(lean_net(model), slots)
        lean.max_length = model.max_length
        return lean
    return model.with_slots(slots)


def batch_engine(pipe: Pipeline, max_batch: int) -> SpeculativeEngine:
    """A SpeculativeEngine of `max_batch` slots over the pipeline's models (the same weights; caches of its own)
    and its k policy. SpecError (runtime) when the pipeline cannot batch (see batch_unsupported)."""
    reason = batch_unsupported(pipe)
    if reason is not None:
        raise SpecError(reason, "max_batch", runtime=True)
    lone = pipe.engine
    target = _with_slots(lone.target, max_batch)
    draft = None if pipe.draft_model is None else _with_slots(pipe.draft_model, max_batch)
    vocab = pipe.vocab_bridge if pipe.vocab_bridge is not None else target.vocab_size
    drafter = None if pipe.drafter == "none" else DRAFTERS[pipe.drafter].make(draft, vocab, max_batch)
    return SpeculativeEngine(target, drafter, lone.eos_token_ids, pipe.k, auto_policy=lone.k_policy,
                             max_length=pipe.context_length, vocabulary=lone.vocabulary, grammars=lone.grammars)


def token_pieces(tokenizer, eog: list[int], vocab_size: int) -> TokenPieces | None:
    """What the infill sampler reads of the target's vocabulary (verispec.core.infill), its texts read on first
    use: each id's bytes, b"" for special tokens (and ids past the tokenizer's); None without a fast tokenizer.
    It ends with the tokenizer's EOS where that ends generation, else the lowest id that does."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or not eog:
        return None

    def load() -> list[bytes]:
        table = token_bytes(backend)
        special = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        pieces = [b"" if i in special else piece for i, piece in enumerate(table[:vocab_size])]
        return pieces + [b""] * (vocab_size - len(pieces))

    eos = getattr(tokenizer, "eos_token_id", None)
    return TokenPieces(load, frozenset(eog), eos if eos in eog else min(eog))


def grammars_for(tokenizer, eog: list[int], vocab_size: int) -> Grammars | None:
    """What compiles requests' constraints for the target (verispec.core.grammar): llguidance reads the fast
    tokenizer's vocabulary on first use, every id up to the model's `vocab_size` (the ones past the tokenizer's
    never allowed), and lets the grammar end with any of the ids that end generation; None without a fast tokenizer."""
    if getattr(tokenizer, "backend_tokenizer", None) is None or not eog:
        return None

    def load():
        from llguidance.hf import from_tokenizer

        return from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=list(eog))

    return Grammars(load, vocab_size)


def load(target: Any = None, draft: Any = None, *, tokenizer: Any = None, drafter: str | None = "auto",
         k: int | str | None = None, device: str = "auto", dtype: str | None = None, backend: str = "auto",
         draft_backend: str = "auto", draft_quant: str = "auto", draft_vocab: int = 0, draft_forward: str = "auto",
         ctx_size: int | None = None, exact_kernels: bool = False, pull_missing: bool = False,
         store: ModelStore | None = None) -> Pipeline:
    """A ready pipeline: `pipe.generate(prompt)`, `pipe.stream(prompt)`.

    `target` / `draft`: a known name, a Hugging Face directory, a .gguf file, a hub id, or a loaded
    transformers model (a loaded target needs `tokenizer=`; a loaded draft must share it). target None: the
    default target; with neither a draft nor a drafter named and k not 0, its backend's own pair where it has
    one (llama.cpp: SmolLM2-135M through hybrid-suffix, see default_refs; where not installed, a warning and
    the backend's drafter), else the default draft where the drafter takes one; the default models must be
    installed (`verispec models pull`, or `pull_missing=True`). `backend`: auto (the fastest for this machine, see
    choose_backend), hf or llamacpp. `drafter`: a name in DRAFTERS (model, ngram, suffix, hybrid,
    hybrid-suffix), auto (the backend's default, see DEFAULTS; the default pair's draft is loaded only when
    that drafter uses one), or None: plain decoding. `k`: draft tokens per round, or 'auto' (None: the
    backend's default with its default drafter, else 4, or 'auto' where llama.cpp runs). The other options
    are the fields of TargetSpec and DraftSpec (`ctx_size` applies to every llama.cpp model of the pair;
    `dtype` None: see choose_dtype). `pipe.reason` says why the backend (and a dtype not asked for) was chosen."""
    if not is_loaded(target):
        target, draft, drafter = default_refs(target, draft, drafter, pull_missing, backend, device, k=k)
    target_spec = TargetSpec(target, backend, device, dtype, ctx_size, tokenizer, exact_kernels)
    if drafter is None:
        if draft is not None:
            raise SpecError("plain decoding (no drafter) takes no draft model", "draft.model")
        return build(target_spec, None, k, store=store)
    draft_spec = DraftSpec(drafter, draft, draft_backend, draft_quant, draft_vocab, draft_forward, ctx_size)
    return build(target_spec, draft_spec, k, store=store)


