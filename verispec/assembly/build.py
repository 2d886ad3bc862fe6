"""Build a pipeline from specifications: the one place front ends load models.

A pipeline is a target model, an optional drafter and k (draft tokens per round). `TargetSpec` and
`DraftSpec` say what to load and how; they are frozen and check each field once, when made. Every rule
about how fields combine lives in `check_specs`. Each axis has one registry at this edge: `BACKENDS`
(backend name -> loader) and `DRAFTERS` (drafter name -> proposer factory). `choose_backend` picks the
target's backend for a machine, `DEFAULTS` the drafter and k each backend gets when none is asked for.
`resolve` turns the specs' "auto" choices into concrete ones (backend, drafter, draft quantisation,
device, dtype), `ModelStore` loads each model once however many pipelines use it (and warms it up), and
`build` puts one pipeline together. `load` is the public entry point over all of it.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from verispec.backends import HFModel
from verispec.backends.base import Model
from verispec.backends.lean import LeanBatch, LeanModel, LeanNet, lean_unsupported
from verispec.backends.linear import orient_linears
from verispec.backends.loading import (
    DTYPES,
    check_same_vocabulary,
    configured_eos_ids,
    eog_token_ids,
    eos_token_ids,
    load_model,
    load_tokenizer,
    resolve_device,
    resolve_gguf,
)
from verispec.backends.loading import resolve as resolve_source
from verispec.backends.quant import quantize_model
from verispec.backends.vocab import frequent_tokens, restrict_head
from verispec.decoding.batch import BatchGenerator
from verispec.decoding.engine import SpeculativeGenerator
from verispec.decoding.policies.base import KPolicy
from verispec.decoding.policies.cost_aware import CostAwareK
from verispec.decoding.policies.tree_budget import TreeBudget
from verispec.names.drafters import (
    BACKEND_NAMES,
    BATCH_DRAFTERS,
    DEVICES,
    DRAFT_FORWARDS,
    QUANT_MODES,
)
from verispec.names.errors import ModelError, SpecError
from verispec.names.k import (
    DEFAULT_K,
    DEFAULTS,
    K_MAX,
    Defaults,
    default_drafter,
    default_k,
)
from verispec.names.k import check_k as names_check_k
from verispec.names.models import DEFAULT_DRAFT, DEFAULT_TARGET, installed, pull
from verispec.pipeline.pipeline import Pipeline
from verispec.proposers import (
    DraftModelProposer,
    HybridProposer,
    NgramProposer,
    SuffixProposer,
)
from verispec.proposers.base import Proposer
from verispec.proposers.rows import BatchDraftModel, ProposerRows
from verispec.proposers.tree_draft import TreeDraftModel


def is_loaded(model: object) -> bool:
    """Whether a spec's model is an already-loaded transformers model (else a reference: name, path, GGUF file)."""
    return isinstance(model, torch.nn.Module)


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
    the model's trained context, bounded by memory, see verispec.backends.llamacpp.context_size);
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


# -- registries ------------------------------------------------------------------------------------


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
            model = LeanModel(hf_model)  # fuses the layers it needs into modules of its own
        except ValueError as exc:
            raise SpecError(str(exc), "draft.forward", runtime=True) from exc
        quantize_model(model.net, request.quant)
        return model, eos
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


@dataclass(frozen=True)
class Drafter:
    """A registry entry: `make(draft model or None, the target's vocabulary size) -> Proposer`;
    `needs_model`: whether it drafts with a draft LM; `auto_policy(k_max) -> KPolicy`: the policy of k = 'auto'
    (token trees: their node budget and depth; chains: cost-aware k)."""

    make: Callable[[Model | None, int], Proposer]
    needs_model: bool
    auto_policy: Callable[[int], KPolicy] = CostAwareK


DRAFTERS: dict[str, Drafter] = {
    "model": Drafter(lambda model, vocab: DraftModelProposer(model, vocab), needs_model=True),
    "ngram": Drafter(lambda model, vocab: NgramProposer(), needs_model=False),
    "suffix": Drafter(lambda model, vocab: SuffixProposer(), needs_model=False),
    "hybrid": Drafter(lambda model, vocab: HybridProposer(NgramProposer(), DraftModelProposer(model, vocab)),
                      needs_model=True),
    "hybrid-suffix": Drafter(lambda model, vocab: HybridProposer(SuffixProposer(), DraftModelProposer(model, vocab)),
                             needs_model=True),
    "tree": Drafter(lambda model, vocab: TreeDraftModel(model, vocab), needs_model=True,
                    auto_policy=lambda k_max: TreeBudget()),
}


# -- resolution and the combination rules -----------------------------------------------------------


@dataclass(frozen=True)
class Machine:
    """What choosing a target's backend depends on. `cuda`: a CUDA device is available; `llama_cpp`:
    llama-cpp-python is importable; `gguf`: the target has a GGUF file (a known model's, a .gguf path, a
    directory holding one); `gguf_only`: that file is all there is (no Hugging Face weights beside it);
    `loaded`: the target is a loaded transformers model; `device`: the device asked for (auto, cpu, cuda[:N])."""

    cuda: bool
    llama_cpp: bool
    gguf: bool
    device: str = "auto"
    gguf_only: bool = False
    loaded: bool = False


def choose_backend(machine: Machine) -> tuple[str, str]:
    """(backend, one-line reason): the backend that decodes the target fastest with the same weights.
    llama.cpp on the CPU when llama-cpp-python is installed and the target has a GGUF: its quantized kernels
    decode a token several times faster there than transformers' bf16 forward. Transformers on CUDA (the
    llama.cpp build that llama-cpp-python installs runs on the CPU; a CUDA build is not detected, so CUDA
    always gets transformers), for a loaded transformers model, and on a CPU without llama.cpp or a GGUF.
    A target that is only a GGUF file needs llama.cpp on the CPU: without it this raises a SpecError
    naming the fixes (install llama-cpp-python, or ask for 'hf', which dequantizes the file)."""
    if machine.loaded:
        return "hf", "transformers: the target is a loaded transformers model"
    if machine.device.startswith("cuda") or (machine.device == "auto" and machine.cuda):
        return "hf", "transformers: a CUDA device (llama.cpp here runs on the CPU)"
    if machine.gguf and machine.llama_cpp:
        return "llamacpp", "llama.cpp: CPU, llama-cpp-python installed, the target has a GGUF"
    if machine.gguf_only:
        from verispec.backends.llamacpp import INSTALL_HINT

        raise SpecError(f"the target is a GGUF file, which runs on llama.cpp on the CPU, but llama-cpp-python is "
                        f"not installed ({INSTALL_HINT}); or ask for the 'hf' backend, which dequantizes the file",
                        "target.backend", (("target.backend", "hf"),), runtime=True)
    if machine.gguf:
        return "hf", "transformers: CPU, llama-cpp-python is not installed"
    return "hf", "transformers: the target has no GGUF file"


def describe_machine(target: TargetSpec) -> Machine:
    """This machine, and what the target reference points at, as choose_backend needs them."""
    cuda = torch.cuda.is_available()
    llama_cpp = importlib.util.find_spec("llama_cpp") is not None
    if is_loaded(target.model):
        return Machine(cuda, llama_cpp, gguf=False, device=target.device, loaded=True)
    try:
        gguf = os.path.isfile(resolve_gguf(target.model))
    except ModelError:
        gguf = False
    try:
        gguf_only = resolve_source(target.model).gguf_file is not None
    except ModelError:
        gguf_only = False
    return Machine(cuda, llama_cpp, gguf, target.device, gguf_only)


def resolve_target_backend(target: TargetSpec) -> tuple[str, str]:
    """(the target's backend, why): as asked, or choose_backend's for 'auto'."""
    if target.backend != "auto":
        return target.backend, f"{BACKEND_NAMES.get(target.backend, target.backend)}: asked for"
    return choose_backend(describe_machine(target))


# CPU feature flags (Linux's /proc/cpuinfo names) of bf16 matrix instructions; without one, bf16 matmuls are
# emulated through fp32 and run slower than fp32 itself (docs/performance.md)
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as Linux lists them in /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.partition(":")[2].split())
    except OSError:
        pass
    return frozenset()


def choose_dtype(device: torch.device, flags: frozenset[str] | None = None) -> tuple[str, str]:
    """(dtype, one-line reason) for a model verispec loads when none is asked for: bf16 where the device
    multiplies bf16 natively (a CUDA GPU that supports it; a CPU with AVX512-BF16 or AMX-BF16), fp16 on an
    older GPU, fp32 on any other CPU, where bf16 is emulated and slower than fp32 (docs/performance.md).
    `flags`: the CPU's feature flags (default: cpu_flags())."""
    if device.type == "cuda":
        if torch.cuda.is_bf16_supported():
            return "bf16", "bf16: the GPU computes in bf16"
        return "fp16", "fp16: the GPU has no bf16"
    flags = cpu_flags() if flags is None else flags
    native = [flag for flag in NATIVE_BF16_FLAGS if flag in flags]
    if native:
        return "bf16", f"bf16: the CPU multiplies bf16 natively ({', '.join(native)})"
    return "fp32", "fp32: the CPU has no native bf16 (neither AVX512-BF16 nor AMX-BF16)"


def resolve_backends(target: TargetSpec, draft: DraftSpec | None) -> tuple[str, str | None]:
    """The backend each model runs on: the target's as asked, or resolve_target_backend's for 'auto'; the
    draft's as asked, or the target's for 'auto' (a transformers target drafts with a transformers draft,
    int4 on the CPU: measured faster than the same draft on llama.cpp, see choose_draft_quant). None: no
    draft model."""
    backend = target.backend if target.backend != "auto" else resolve_target_backend(target)[0]
    if draft is None or draft.model is None:
        return backend, None
    return backend, backend if draft.backend == "auto" else draft.backend


def choose_draft_quant(draft_quant: str, draft_backend: str, device: torch.device) -> str:
    """auto: int4 for a transformers draft on the CPU, else none: a small int4 draft costs a fraction of a
    bf16 draft step (the packed kernels are matrix-vector kernels) and prefills through its bf16 weights
    (see verispec.backends.quant); docs/performance.md compares the draft variants. GGUF drafts are quantised
    already; on CUDA the packed CPU kernels do not apply."""
    if draft_quant not in ("auto", *QUANT_MODES):
        raise SpecError(f"unknown draft quantisation '{draft_quant}' (use auto, {', '.join(QUANT_MODES)})",
                        "draft.quant")
    if draft_quant != "auto":
        return draft_quant
    return "int4" if draft_backend == "hf" and device.type == "cpu" else "none"


def _model_device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def resolve(target: TargetSpec, draft: DraftSpec | None) -> tuple[TargetSpec, DraftSpec | None, torch.device]:
    """Specs with every 'auto' decided (backends, drafter, draft quantisation, device, dtype), checked by
    check_specs, and the device the pipeline runs on."""
    backend, draft_backend = resolve_backends(target, draft)
    target = replace(target, backend=backend)
    if is_loaded(target.model):
        device = _model_device(target.model)
    else:
        try:
            device = resolve_device(target.device)
        except ModelError as exc:  # e.g. CUDA asked for where there is none
            raise SpecError(str(exc), "target.device") from None
        if target.dtype is None:
            target = replace(target, dtype=choose_dtype(device)[0])
    if draft is not None and draft.drafter == "auto":
        draft = replace(draft, drafter=default_drafter(backend, draft.model is not None))
    if draft is not None and draft.model is not None:
        # a loaded draft is used as given: quantisation would rebuild its layers in place
        quant = "none" if draft.quant == "auto" and is_loaded(draft.model) else draft.quant
        draft = replace(draft, backend=draft_backend, quant=choose_draft_quant(quant, draft_backend, device))
    check_specs(target, draft, device)
    return replace(target, device=str(device)), draft, device


def check_specs(target: TargetSpec, draft: DraftSpec | None, device: torch.device) -> None:
    """Every rule about how the fields of resolved specs combine (each field alone was checked when its
    spec was made); `device`: where the pipeline will run. Raises SpecError naming the field at fault."""
    if is_loaded(target.model):
        if target.device not in ("auto", str(device), device.type):
            raise SpecError(f"a loaded model runs on the device it is on ({device}), not '{target.device}': move "
                            f"it first", "target.device")
        if not BACKENDS[target.backend].loaded_models:
            raise SpecError(f"a loaded transformers model runs on a backend that takes one (not "
                            f"'{target.backend}'); pass a GGUF file for llama.cpp", "target.backend")
        if target.tokenizer is None:
            raise SpecError("a loaded target model needs its tokenizer", "target.tokenizer")
        if target.dtype is not None:
            raise SpecError("a loaded model keeps its own dtype: cast it before passing it", "target.dtype")
    if draft is None:
        return
    drafter = DRAFTERS[draft.drafter]
    if drafter.needs_model and draft.model is None:
        raise SpecError(f"the '{draft.drafter}' drafter needs a draft model", "draft.model",
                        (("draft.drafter", "ngram"), ("draft", None)))
    if not drafter.needs_model:
        if draft.model is not None:
            raise SpecError(f"the '{draft.drafter}' drafter takes no draft model", "draft.model")
        for name, value, default in (("quant", draft.quant, ("auto", "none")), ("vocab", draft.vocab, (0,)),
                                     ("forward", draft.forward, ("auto",)), ("backend", draft.backend, ("auto",))):
            if value not in default:
                raise SpecError(f"the draft {name} applies to a draft model; the '{draft.drafter}' drafter has none",
                                f"draft.{name}")
        return
    backend = BACKENDS[draft.backend]
    if not backend.draft_options:
        fix = (("draft.backend", "hf"),)
        if draft.quant != "none":
            raise SpecError(f"draft quantisation '{draft.quant}' applies to a transformers draft; a GGUF model is "
                            f"already quantized", "draft.quant", fix)
        if draft.vocab:
            raise SpecError(f"a reduced draft vocabulary applies to a transformers draft ({draft.backend} always "
                            f"scores the whole vocabulary)", "draft.vocab", fix)
        if draft.forward != "auto":
            raise SpecError(f"the draft forward '{draft.forward}' applies to a transformers draft", "draft.forward",
                            fix)
    if is_loaded(draft.model):
        if not backend.loaded_models:
            raise SpecError(f"a loaded draft model runs on a backend that takes one (not '{draft.backend}')",
                            "draft.backend")
        if draft.quant != "none" or draft.vocab:
            raise SpecError("quantisation and a reduced vocabulary change a draft's layers in place: pass the draft "
                            "by reference (name or path) to have them", "draft.quant" if draft.quant != "none"
                            else "draft.vocab")


def default_refs(target: str | None, draft: str | None, drafter: str | None = "model",
                 pull_missing: bool = False, backend: str = "auto", device: str = "auto") -> tuple[str, str | None]:
    """Fill in the default pair (target None: the default target, and the default draft when none is given
    and the drafter drafts with a model); make sure the default models are installed (pull them when
    `pull_missing`). `drafter` None: plain decoding, no draft; 'auto': the default drafter of the target's
    backend (`backend` and `device` as TargetSpec takes them), so that a free default drafter loads no draft."""
    default_pair = target is None
    if default_pair:
        target = DEFAULT_TARGET
    _ensure_installed(target, "target.model", pull_missing)  # before its backend is chosen: it looks at the files
    if drafter == "auto":
        drafter = default_drafter(resolve_target_backend(TargetSpec(target, backend, device))[0], draft is not None)
    if default_pair and draft is None and drafter in DRAFTERS and DRAFTERS[drafter].needs_model:
        draft = DEFAULT_DRAFT
    _ensure_installed(draft, "draft.model", pull_missing)
    return target, draft


def _ensure_installed(ref: str | None, field_name: str, pull_missing: bool) -> None:
    if isinstance(ref, str) and ref in (DEFAULT_TARGET, DEFAULT_DRAFT) and installed(ref) is None:
        if not pull_missing:
            raise SpecError(f"the default model '{ref}' is not installed: run `verispec models pull`", field_name,
                            (("pull", True),), runtime=True)
        pull(ref)


# -- loading each model once --------------------------------------------------------------------------


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
    model.forward(tokens)
    model.forward(tokens[:1], last_only=True)
    model.reset()


class ModelStore:
    """Loaded tokenizers and models, keyed by what determines them (the reference, backend, device, dtype,
    and for a draft its quantisation, vocabulary and forward), so that pipelines built from specs naming the
    same model load it once. A target and a draft are never shared with each other, even when the specs
    name the same model: one generation uses both caches at once.

    Pipelines that share a loaded model share its KV cache, and each generator believes its cache holds
    what it left there. So at most one of them generates at a time, and each is reset
    (`pipeline.generator.reset()`) before it generates after another one used the shared model."""

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
        and `vocab_size` (the target's) pick a reduced vocabulary's tokens."""
        key = ("draft", _model_key(spec.model), spec.backend, str(device), dtype, spec.quant, spec.vocab,
               spec.forward, spec.ctx_size)

        def make() -> Model:
            head_ids = frequent_tokens(tokenizer, spec.vocab, vocab_size) if spec.vocab else None
            request = LoadRequest(spec.model, device, dtype, spec.ctx_size, spec.quant, head_ids, spec.forward)
            model = BACKENDS[spec.backend].load(request)[0]
            warm_up(model)
            return model

        return self._get(key, make)

    def transformers_model(self, ref: str, device: torch.device, dtype: torch.dtype):
        """A plain transformers model (no quantisation, full head, its own forward), e.g. for a reference
        implementation to run."""
        return self._get(("transformers", ref, str(device), dtype), lambda: load_model(ref, device, dtype))


# -- the builder ----------------------------------------------------------------------------------------


def _dtype(target: TargetSpec) -> torch.dtype:
    """The torch dtype of a resolved target's weights (a loaded model keeps its own)."""
    if is_loaded(target.model):
        return next(target.model.parameters()).dtype
    return DTYPES[target.dtype]


def _forward_name(model: Model | None, backend: str | None) -> str:
    if model is None or backend != "hf":
        return "none"
    return "lean" if isinstance(model, LeanModel) else "transformers"


def build(target: TargetSpec, draft: DraftSpec | None = None, k: int | str | None = None, *, k_max: int = K_MAX,
          store: ModelStore | None = None) -> Pipeline:
    """A pipeline for `target` drafted by `draft` (None: plain decoding) with k draft tokens per round (an
    integer >= 0, 'auto', or None: DEFAULTS' k for the backend's default drafter with any draft model on the
    target's backend, else default_k). Models come
    from `store` (a fresh one when None): pipelines built on one store share the models their specs have in
    common (see ModelStore for the reset rule). Refuses an incompatible pair (different vocabularies) before
    loading any weights. Generation ends at the configured EOS ids and at every token llama.cpp treats as
    the end of generation, on every backend alike."""
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
    defaults = DEFAULTS.get(target.backend)
    if (k is None and default_pair and defaults is not None and draft.drafter == defaults.drafter
            and draft_backend in (None, target.backend)):  # the backend's own default pair
        k = defaults.k
        name = BACKEND_NAMES.get(target.backend, target.backend)
        reason += f"; drafter {draft.drafter} and k={k}: the {name} defaults"
    _check_exact_kernels(target, k)
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
    if has_model and not is_loaded(draft.model):
        check_same_vocabulary(tokenizer, store.tokenizer(draft.model), target.label, draft.label)
    times["tokenizers"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    target_model, eos = store.target(target, dtype)
    times["target"] = time.perf_counter() - t0
    draft_model = None
    if has_model:
        t0 = time.perf_counter()
        draft_model = store.draft(draft, device, dtype, tokenizer, target_model.vocab_size)
        times["draft"] = time.perf_counter() - t0
    if tree:
        target_model, draft_model = _tree_models(target_model, draft_model)
    proposer = None if draft is None else DRAFTERS[draft.drafter].make(draft_model, target_model.vocab_size)
    end = eog_token_ids(tokenizer) if target.tokenizer is not None else store.end_tokens(target.model)
    eos = sorted({*eos, *end})
    if k is None:
        k = "auto" if tree else default_k(target.backend, draft_backend) if draft is not None else 0
    policy = None if draft is None else DRAFTERS[draft.drafter].auto_policy(k_max)
    generator = SpeculativeGenerator(target_model, proposer, eos, k, auto_policy=policy)
    kernels = None
    if "llamacpp" in (target.backend, draft_backend):
        from verispec.backends.llamacpp import kernels as llama_kernels

        kernels = llama_kernels().describe()
    pipe = Pipeline(generator, tokenizer, target, draft, device, draft_model, _forward_name(draft_model, draft_backend),
                    times, reason, kernels)
    batch_reason = batch_unsupported(pipe)
    return replace(pipe, batch_reason=batch_reason,
                   make_batch=None if batch_reason else functools.partial(batch_generator, pipe))


def _check_exact_kernels(target: TargetSpec, k: int | str | None) -> None:
    """Exact kernels are llama.cpp's, and cover verification passes of up to EXACT_WIDTH tokens."""
    if not target.exact_kernels:
        return
    if target.backend != "llamacpp":
        raise SpecError("exact kernels are llama.cpp's (on transformers, --dtype fp32 verifies exactly)",
                        "target.exact_kernels", (("target.backend", "llamacpp"),))
    from verispec.backends.llamacpp import EXACT_WIDTH

    if isinstance(k, int) and k + 1 > EXACT_WIDTH:
        raise SpecError(f"exact kernels cover passes of at most {EXACT_WIDTH} tokens: k must be at most "
                        f"{EXACT_WIDTH - 1}, got {k}", "k")


def _tree_models(target: Model, draft: Model) -> tuple[Model, Model]:
    """The target and draft of a tree drafter: both verify trees on the lean path (the target on a LeanNet of
    its transformers model, which holds fused copies of some weights: see _lean_net)."""
    if not isinstance(draft, LeanModel):
        raise SpecError("token trees need the draft on the lean path (draft forward lean, an architecture it runs)",
                        "draft.forward", runtime=True)
    if isinstance(target, LeanModel):
        return target, draft
    reason = lean_unsupported(target.model)
    if reason is not None:
        raise SpecError(f"token trees run on the lean path, which cannot run {reason}", "draft.drafter", runtime=True)
    lean = LeanModel(_lean_net(target))
    lean.max_length = target.max_length
    return lean, draft


_LEAN_NETS: "weakref.WeakKeyDictionary[Any, LeanNet]" = weakref.WeakKeyDictionary()  # transformers model -> its net


def batch_unsupported(pipe: Pipeline) -> str | None:
    """Why `pipe` cannot decode a batch (verispec.decoding.batch), or None when it can."""
    if pipe.backend != "hf" or (pipe.draft_model is not None and pipe.draft_backend != "hf"):
        return "batched decoding runs on the transformers backend (llama.cpp decodes one sequence at a time here)"
    if pipe.drafter not in ("none", *BATCH_DRAFTERS):
        return f"the {pipe.drafter} drafter does not batch (use {', '.join(BATCH_DRAFTERS)} or none)"
    models = [pipe.generator.target] + ([pipe.draft_model] if pipe.draft_model is not None else [])
    if isinstance(pipe.draft_model, HFModel) and pipe.draft_quant != "none":
        return "a quantised draft batches on the lean path only (draft forward lean)"
    for model in models:
        if not isinstance(model, LeanModel):
            reason = lean_unsupported(model.model)
            if reason is not None:
                return f"batched decoding runs on the lean path, which cannot run {reason}"
    return None


def _lean_net(model: Model) -> LeanNet:
    """The LeanNet of a transformers-backed Model, built once per transformers model: it holds fused copies of
    the q/k/v and gate/up weights (about 60% of the model's weights more in memory)."""
    if isinstance(model, LeanModel):
        return model.net
    if model.model not in _LEAN_NETS:
        _LEAN_NETS[model.model] = LeanNet(model.model)
    return _LEAN_NETS[model.model]


def batch_generator(pipe: Pipeline, max_batch: int) -> BatchGenerator:
    """A BatchGenerator of `max_batch` slots over the pipeline's models (the same weights; caches of its own).
    SpecError (runtime) when the pipeline cannot batch (see batch_unsupported)."""
    if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
        raise SpecError(f"max_batch must be an integer >= 1, got {max_batch!r}", "max_batch")
    reason = batch_unsupported(pipe)
    if reason is not None:
        raise SpecError(reason, "max_batch", runtime=True)
    target = pipe.generator.target
    drafter = None
    if pipe.draft_model is not None:
        drafter = BatchDraftModel(LeanBatch(_lean_net(pipe.draft_model), max_batch), target.vocab_size)
    elif pipe.drafter != "none":
        make = DRAFTERS[pipe.drafter].make
        drafter = ProposerRows(lambda: make(None, target.vocab_size))
    return BatchGenerator(LeanBatch(_lean_net(target), max_batch), drafter, pipe.generator.prepare, pipe.k,
                          pipe.context_length)


def build_pipeline(
    target: str,
    draft: str | None,
    device: str = "auto",
    dtype: str = "bf16",
    num_draft_tokens: int | str = DEFAULT_K,
    drafter: str = "model",
    draft_quant: str = "auto",
    backend: str = "hf",
    draft_backend: str | None = "auto",
    draft_vocab: int = 0,
    draft_forward: str = "auto",
    ctx_size: int | None = None,
) -> Pipeline:
    """`build` with its specs given as flat arguments (references only; draft None with the 'model' or 'hybrid'
    drafter: plain decoding)."""
    spec = TargetSpec(target, backend, device, dtype, ctx_size)
    if drafter in DRAFTERS and not DRAFTERS[drafter].needs_model:
        draft_spec = DraftSpec(drafter)
    elif draft is None:
        draft_spec = None
    else:
        draft_spec = DraftSpec(drafter, draft, draft_backend or "auto", draft_quant, draft_vocab, draft_forward,
                               ctx_size)
    return build(spec, draft_spec, num_draft_tokens)



def load(target: Any = None, draft: Any = None, *, tokenizer: Any = None, drafter: str | None = "auto",
         k: int | str | None = None, device: str = "auto", dtype: str | None = None, backend: str = "auto",
         draft_backend: str = "auto", draft_quant: str = "auto", draft_vocab: int = 0, draft_forward: str = "auto",
         ctx_size: int | None = None, exact_kernels: bool = False, pull_missing: bool = False,
         store: ModelStore | None = None) -> Pipeline:
    """A ready pipeline: `pipe.generate(prompt)`, `pipe.stream(prompt)`.

    `target` / `draft`: a known name, a Hugging Face directory, a .gguf file, a hub id, or a loaded
    transformers model (a loaded target needs `tokenizer=`; a loaded draft must share it). target None: the
    default pair (the default draft too unless one is given); the default models must be installed
    (`verispec models pull`, or `pull_missing=True`). `backend`: auto (the fastest for this machine, see
    choose_backend), hf or llamacpp. `drafter`: a name in DRAFTERS (model, ngram, suffix, hybrid,
    hybrid-suffix), auto (the backend's default, see DEFAULTS; the default pair's draft is loaded only when
    that drafter uses one), or None: plain decoding. `k`: draft tokens per round, or 'auto' (None: the
    backend's default with its default drafter, else 4, or 'auto' where llama.cpp runs). The other options
    are the fields of TargetSpec and DraftSpec (`ctx_size` applies to every llama.cpp model of the pair;
    `dtype` None: see choose_dtype). `pipe.reason` says why the backend (and a dtype not asked for) was chosen."""
    if not is_loaded(target):
        target, draft = default_refs(target, draft, drafter, pull_missing, backend, device)
    target_spec = TargetSpec(target, backend, device, dtype, ctx_size, tokenizer, exact_kernels)
    if drafter is None:
        if draft is not None:
            raise SpecError("plain decoding (no drafter) takes no draft model", "draft.model")
        return build(target_spec, None, k, store=store)
    draft_spec = DraftSpec(drafter, draft, draft_backend, draft_quant, draft_vocab, draft_forward, ctx_size)
    return build(target_spec, draft_spec, k, store=store)


__all__ = [
    "BACKENDS", "DEFAULTS", "DRAFTERS", "Backend", "Defaults", "DraftSpec", "Drafter", "LoadRequest", "Machine",
    "ModelStore", "SpecError", "TargetSpec", "batch_generator", "batch_unsupported", "build", "check_specs",
    "choose_backend", "choose_draft_quant", "choose_dtype",
    "default_drafter", "default_k", "default_refs", "describe_machine", "load", "resolve", "resolve_backends",
    "resolve_target_backend", "warm_up", "build_pipeline",
]
