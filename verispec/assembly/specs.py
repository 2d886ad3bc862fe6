"""What to build: TargetSpec and DraftSpec, frozen, each field checked once when made (SpecError names the field
at fault), and k's check as a spec field."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from verispec.assembly.registry import BACKENDS, DRAFTERS, is_loaded
from verispec.backends.loading import DTYPES
from verispec.names.drafters import DEVICES, DRAFT_FORWARDS, QUANT_MODES
from verispec.names.errors import SpecError
from verispec.names.k import check_k as names_check_k


def _check_reference(model: object, field_name: str, optional: bool) -> object:
    if model is None and optional:
        return None
    if isinstance(model, os.PathLike):
        return os.fspath(model)
    if isinstance(model, str) and model or is_loaded(model):
        return model
    raise SpecError(f"a model is a known name, a directory, a GGUF file, a hub id or a loaded transformers model, "
                    f"got {model!r}", field_name)


def _check_device(device: str, field_name: str) -> None:
    base, _, index = device.partition(":")
    if base not in DEVICES or (index and (base != "cuda" or not index.isdigit())):
        raise SpecError(f"unknown device '{device}' (use auto, cpu or cuda)", field_name)


def _check_ctx_size(ctx_size: int | None, field_name: str) -> None:
    if ctx_size is not None and (isinstance(ctx_size, bool) or not isinstance(ctx_size, int) or ctx_size < 1):
        raise SpecError(f"the context size must be a positive number of tokens, got {ctx_size!r}", field_name)


@dataclass(frozen=True)
class TargetSpec:
    """The model whose distribution is sampled.

    `model`: a known name, a Hugging Face directory, a .gguf file, a hub id, or a loaded transformers model
    (then `tokenizer` is required, and the model runs where it is, in its own dtype). `backend`: a name in
    BACKENDS, or auto (the fastest for this machine and target, see choose_backend). `device`: auto (CUDA
    when available), cpu, cuda or cuda:N. `dtype`: bf16, fp16 or fp32 for a model verispec loads (None:
    the fastest the device computes in, see choose_dtype). `ctx_size`: llama.cpp's context in tokens (None:
    the model's trained context, bounded by memory, see verispec.backends.gguf.context_size);
    transformers models ignore it. `exact_kernels`: llama.cpp computes every pass of up to EXACT_WIDTH tokens
    with batch-invariant kernels, so a verification pass gives bitwise the logits plain decoding would
    (process-wide; needs verispec's llama.cpp build, see verispec.backends.llamacpp.use_exact_kernels).
    """

    model: Any
    backend: str = "auto"
    device: str = "auto"
    dtype: str | None = None
    ctx_size: int | None = None
    tokenizer: Any = field(default=None, compare=False)
    exact_kernels: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "model", _check_reference(self.model, "target.model", optional=False))
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise SpecError(f"unknown backend '{self.backend}' (use auto, {', '.join(BACKENDS)})", "target.backend")
        _check_device(self.device, "target.device")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise SpecError(f"unknown dtype '{self.dtype}' (use {', '.join(DTYPES)})", "target.dtype")
        _check_ctx_size(self.ctx_size, "target.ctx_size")
        if not isinstance(self.exact_kernels, bool):
            raise SpecError(f"exact_kernels is True or False, got {self.exact_kernels!r}", "target.exact_kernels")

    @property
    def label(self) -> str:
        """The model reference as text (a loaded model: its name_or_path, else its class name)."""
        return _label(self.model)


@dataclass(frozen=True)
class DraftSpec:
    """How drafts are made. `drafter`: a name in DRAFTERS (model: a draft LM; ngram: prompt lookup, no model;
    suffix: suffix-tree lookup over the sequence and this pipeline's earlier outputs, no model; hybrid /
    hybrid-suffix: n-gram / suffix lookup when it matches confidently, the draft LM otherwise), or auto (the
    target backend's default in DEFAULTS; 'model' when that takes no draft model and one is given). `model`:
    the draft LM, in the forms TargetSpec takes (it must share the target's tokenizer). `backend`: a name in
    BACKENDS, or auto (the target's). `quant`: weight-only quantisation of a transformers draft: none, int8, int4 or auto (see
    choose_draft_quant). `vocab` N > 0: a transformers draft scores only ~N frequent tokens
    (verispec.backends.vocab). `forward`: a transformers draft runs on verispec's lean decode path or on transformers'
    own forward (auto: lean where the architecture allows). `ctx_size`: as TargetSpec's, for a llama.cpp
    draft. None of these change the output distribution, only the speed."""

    drafter: str = "auto"
    model: Any = None
    backend: str = "auto"
    quant: str = "auto"
    vocab: int = 0
    forward: str = "auto"
    ctx_size: int | None = None

    def __post_init__(self) -> None:
        if self.drafter != "auto" and self.drafter not in DRAFTERS:
            raise SpecError(f"unknown drafter '{self.drafter}' (use auto, {', '.join(DRAFTERS)})", "draft.drafter")
        object.__setattr__(self, "model", _check_reference(self.model, "draft.model", optional=True))
        if self.backend != "auto" and self.backend not in BACKENDS:
            raise SpecError(f"unknown draft backend '{self.backend}' (use auto, {', '.join(BACKENDS)})",
                            "draft.backend")
        if self.quant not in ("auto", *QUANT_MODES):
            raise SpecError(f"unknown draft quantisation '{self.quant}' (use auto, {', '.join(QUANT_MODES)})",
                            "draft.quant")
        if isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 0:
            raise SpecError(f"the reduced draft vocabulary must be >= 0 tokens (0 = the whole vocabulary), got "
                            f"{self.vocab!r}", "draft.vocab")
        if self.forward not in DRAFT_FORWARDS:
            raise SpecError(f"unknown draft forward '{self.forward}' (use {', '.join(DRAFT_FORWARDS)})",
                            "draft.forward")
        _check_ctx_size(self.ctx_size, "draft.ctx_size")

    @property
    def label(self) -> str | None:
        return None if self.model is None else _label(self.model)


def _label(model: object) -> str:
    if is_loaded(model):
        return getattr(model, "name_or_path", "") or type(model).__name__
    return str(model)


def check_k(k: int | str) -> int | str:
    """k: draft tokens per round (names.k.check_k) as a spec field."""
    try:
        return names_check_k(k)
    except ValueError as exc:
        raise SpecError(str(exc), "k") from exc
