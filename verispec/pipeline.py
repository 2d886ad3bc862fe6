"""Build a ready-to-use generator from model references: the one place front ends load models."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from verispec.backends import HFModel
from verispec.backends.lean import LeanModel, lean_unsupported
from verispec.engine import SpeculativeGenerator
from verispec.loading import (
    check_same_vocabulary,
    configured_eos_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_dtype,
    resolve_gguf,
)
from verispec.models import DEFAULT_DRAFT, DEFAULT_TARGET, ModelError, installed, pull
from verispec.proposers import DraftModelProposer, HybridProposer, NgramProposer
from verispec.quant import QUANT_MODES, quantize_model
from verispec.vocab import frequent_tokens, restrict_head

DRAFTERS = ("model", "ngram", "hybrid")
BACKENDS = ("hf", "llamacpp")
DRAFT_FORWARDS = ("auto", "lean", "transformers")
LLAMA_CONTEXT = 8192  # llama.cpp context (KV cells) per model


@dataclass
class Pipeline:
    generator: SpeculativeGenerator
    tokenizer: object
    target_ref: str
    draft_ref: str | None
    device: torch.device
    drafter: str
    backend: str = "hf"
    draft_backend: str | None = None
    draft_quant: str = "none"
    draft_forward: str = "none"  # a transformers draft's forward: lean or transformers
    load_seconds: dict[str, float] = field(default_factory=dict)
    extras: dict = field(default_factory=dict)  # objects a front end keeps with the models (bench references)


def default_refs(target: str | None, draft: str | None, speculate: bool, pull_missing: bool = False,
                 drafter: str = "model"):
    """Fill in the default pair; say how to install it when it is missing."""
    if drafter not in DRAFTERS:
        raise ModelError(f"unknown drafter '{drafter}' (use {', '.join(DRAFTERS)})")
    speculate_with_model = speculate and drafter != "ngram"
    if target is None:
        target = DEFAULT_TARGET
        if draft is None and speculate_with_model:
            draft = DEFAULT_DRAFT
    if speculate_with_model and draft is None:
        raise ModelError("no draft model: pass --draft (or --drafter ngram, or --no-speculation for plain decoding)")
    speculate = speculate_with_model
    for ref in (target, draft if speculate else None):
        if ref in (DEFAULT_TARGET, DEFAULT_DRAFT) and installed(ref) is None:
            if not pull_missing:
                raise ModelError(f"the default model '{ref}' is not installed: run `verispec models pull` (or pass --pull)")
            pull(ref)
    return target, draft if speculate else None


def _check_backend(name: str) -> str:
    if name not in BACKENDS:
        raise ModelError(f"unknown backend '{name}' (use {', '.join(BACKENDS)})")
    return name


def choose_draft_quant(draft_quant: str, draft_backend: str, device: torch.device) -> str:
    """auto: int4 for a transformers draft on the CPU, else none. Measured here (HumanEval, 6 prompts, one
    run, k=auto): the 0.5B draft in int4 costs ~0.15 of a bf16 1.5B verify pass (~0.5 in bf16), gives
    2.41x over plain decoding against 2.25x for the same draft's GGUF on llama.cpp, and prefills long
    prompts several times faster than llama.cpp does here. GGUF drafts are quantised already; on CUDA
    the packed CPU kernels do not apply."""
    if draft_quant not in ("auto", *QUANT_MODES):
        raise ModelError(f"unknown draft quantisation '{draft_quant}' (use auto, {', '.join(QUANT_MODES)})")
    if draft_quant != "auto":
        return draft_quant
    return "int4" if draft_backend == "hf" and device.type == "cpu" else "none"


def load_backend(ref: str, backend: str, device: torch.device, dtype: torch.dtype, quant: str = "none",
                 head_ids: torch.Tensor | None = None, forward: str = "transformers"):
    """(Model, EOS ids it knows of) for `ref` on `backend`; `head_ids`: score only these tokens (a reduced
    draft vocabulary), `quant`: weight-only draft quantisation, `forward`: transformers' own forward or the
    lean decode path (verispec.backends.lean; auto: lean where the architecture allows). The last three apply
    to transformers drafts only."""
    if forward not in DRAFT_FORWARDS:
        raise ModelError(f"unknown draft forward '{forward}' (use {', '.join(DRAFT_FORWARDS)})")
    if backend == "llamacpp":
        from verispec.backends.llamacpp import LlamaCppModel

        if quant != "none":
            raise ModelError(f"--draft-quant {quant} applies to the transformers backend; a GGUF model is already "
                             f"quantized")
        if head_ids is not None:
            raise ModelError("--draft-vocab applies to the transformers backend (llama.cpp always scores the "
                             "whole vocabulary): add --draft-backend hf")
        model = LlamaCppModel(resolve_gguf(ref), device, n_ctx=LLAMA_CONTEXT)
        return model, [model.llm.token_eos(), *configured_eos_ids(ref)]
    hf_model = load_model(ref, device, dtype)
    eos = eos_token_ids(hf_model, None)
    if head_ids is not None:
        restrict_head(hf_model, head_ids)
    if forward == "auto":
        forward = "lean" if lean_unsupported(hf_model) is None else "transformers"
    if forward == "lean":
        try:
            model = LeanModel(hf_model)  # fuses the layers it needs; hf_model's other modules are dropped
        except ValueError as exc:
            raise ModelError(str(exc)) from exc
        quantize_model(model.net, quant)
        return model, eos
    return HFModel(quantize_model(hf_model, quant)), eos


def load_draft(ref: str, backend: str, device: torch.device, dtype: torch.dtype, quant: str, vocab: int,
               tokenizer, target_vocab: int, forward: str = "auto") -> DraftModelProposer:
    """A draft-model proposer for `ref` on `backend` (transformers: `quant`, `vocab` > 0 = reduced head,
    `forward` lean or transformers)."""
    head_ids = frequent_tokens(tokenizer, vocab, target_vocab) if vocab else None
    model, _ = load_backend(ref, backend, device, dtype, quant, head_ids, forward)
    return DraftModelProposer(model, target_vocab)


def parse_draft_variant(text: str) -> tuple[str, str, int, str]:
    """'llamacpp', 'hf', 'hf-int4', 'hf-int8-v32768', 'hf-v16384', 'hf-int4-transformers' ->
    (backend, quant, vocab, forward)."""
    parts = text.strip().split("-")
    backend, quant, vocab, forward = parts[0], "none", 0, "auto"
    rest = parts[1:]
    if rest and rest[0] in QUANT_MODES:
        quant = rest.pop(0)
    if rest and rest[0].startswith("v") and rest[0][1:].isdigit():
        vocab = int(rest.pop(0)[1:])
    if rest and rest[0] in DRAFT_FORWARDS[1:]:
        forward = rest.pop(0)
    if backend not in BACKENDS or rest or (backend == "llamacpp" and (quant != "none" or vocab or forward != "auto")):
        raise ModelError(f"unknown draft variant '{text}' (e.g. llamacpp, hf, hf-int4, hf-int4-v32768, "
                         f"hf-int4-transformers)")
    return backend, quant, vocab, forward


def build_pipeline(
    target: str,
    draft: str | None,
    device: str = "auto",
    dtype: str = "bf16",
    num_draft_tokens: int | str = 4,
    drafter: str = "model",
    draft_quant: str = "auto",
    backend: str = "hf",
    draft_backend: str | None = "auto",
    draft_vocab: int = 0,
    draft_forward: str = "auto",
) -> Pipeline:
    """`drafter`: model (the draft LM), ngram (prompt lookup, no draft model), hybrid (n-gram when it has a
    confident match, the draft LM otherwise). `backend` / `draft_backend`: hf (transformers) or llamacpp
    (GGUF on llama.cpp), mixed as wanted; draft_backend None or "auto" = the target's. `draft_quant`:
    none, int8, int4 or auto (see choose_draft_quant). `draft_vocab` N > 0: the draft scores only ~N
    frequent tokens (verispec.vocab). `draft_forward`: a transformers draft runs on verispec's lean decode
    path (auto: where the architecture allows) or on transformers' own forward."""
    if drafter not in DRAFTERS:
        raise ModelError(f"unknown drafter '{drafter}' (use {', '.join(DRAFTERS)})")
    backend = _check_backend(backend)
    if drafter == "ngram":
        draft = None
    dev, dt = resolve_device(device), resolve_dtype(dtype)
    if draft_vocab < 0:
        raise ModelError(f"--draft-vocab must be >= 0 (0 = the whole vocabulary), got {draft_vocab}")
    # auto follows the target: a transformers target drafts with a transformers draft, int4 on the CPU
    # (measured faster than the same draft on llama.cpp, see choose_draft_quant)
    draft_backend = backend if draft_backend in (None, "auto") else _check_backend(draft_backend)
    draft_quant = choose_draft_quant(draft_quant, draft_backend, dev)
    if "llamacpp" in (backend, draft_backend if draft is not None else backend):
        from verispec.backends.llamacpp import import_llama_cpp

        import_llama_cpp()  # say how to install it before loading anything
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(target)
    if draft is not None:  # refuse an incompatible pair before loading any weights
        check_same_vocabulary(tokenizer, load_tokenizer(draft), target, draft)
    times["tokenizers"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    target_model, eos = load_backend(target, backend, dev, dt)
    times["target"] = time.perf_counter() - t0
    proposer = None
    if drafter == "ngram":
        proposer = NgramProposer()
    elif draft is not None:
        t0 = time.perf_counter()
        model_proposer = load_draft(draft, draft_backend, dev, dt, draft_quant, draft_vocab, tokenizer,
                                    target_model.vocab_size, draft_forward)
        times["draft"] = time.perf_counter() - t0
        proposer = HybridProposer(NgramProposer(), model_proposer) if drafter == "hybrid" else model_proposer
    eos = sorted({*eos, *eos_token_ids(None, tokenizer)})
    engine = SpeculativeGenerator(target_model, proposer, eos, num_draft_tokens)
    has_draft = draft is not None
    forward = "none"
    if has_draft and draft_backend == "hf":
        forward = "lean" if isinstance(model_proposer.model, LeanModel) else "transformers"
    return Pipeline(engine, tokenizer, target, draft, dev, drafter if proposer is not None else "none", backend,
                    draft_backend if has_draft else None, draft_quant if has_draft else "none", forward, times)
