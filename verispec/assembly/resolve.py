"""From specs to concrete choices: the target's backend for this machine (`choose_backend`), the dtype, the draft's
backend and quantisation, the drafter for 'auto' (`resolve`), and every rule about how fields combine
(`check_specs`); the default models when none are named (`default_refs`)."""

from __future__ import annotations

import importlib.util
import os
import warnings
from dataclasses import dataclass, replace

import torch

from verispec.assembly.registry import BACKENDS, DRAFTERS, is_loaded
from verispec.assembly.specs import DraftSpec, TargetSpec
from verispec.backends.loading import resolve as resolve_source
from verispec.backends.loading import resolve_device, resolve_gguf
from verispec.catalog import DEFAULT_DRAFT, DEFAULT_TARGET, default_models, installed, pull
from verispec.names.drafters import BACKEND_NAMES, QUANT_MODES
from verispec.names.errors import ModelError, SpecError
from verispec.names.k import backend_defaults, default_drafter


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
        gguf_only = resolve_source(target.model, weights=False).gguf_file is not None
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
                 pull_missing: bool = False, backend: str = "auto", device: str = "auto",
                 serving: bool = False, k: int | str | None = None
                 ) -> tuple[str, str | None, str | None]:
    """(target, draft, drafter) with the defaults filled in. target None: the default target; with no draft
    given, drafter 'auto' becomes its backend's own pair where DEFAULTS has one (`pair_drafter` drafting with
    `draft`) for one user's generation, not where `serving` (a server's requests share each pass) nor where
    `k` is 0 (nothing is drafted: the pair's draft is not loaded); else 'auto' stays (the backend's default
    drafter, see resolve), with the catalog's default draft where that drafter, or a named one, drafts with a
    model (at k 0 too: its drafter needs one). `drafter` None: plain decoding, no draft; `backend` and `device` as
    TargetSpec takes them. The default models are made sure to be installed (pulled when `pull_missing`); a
    pair's draft that is not installed and not to be pulled leaves the backend's default drafter, with a
    warning."""
    default_pair = target is None
    if default_pair:
        target = DEFAULT_TARGET
    _ensure_installed(target, "target.model", pull_missing)  # before its backend is chosen: it looks at the files
    if default_pair and draft is None and drafter == "auto":
        name = resolve_target_backend(TargetSpec(target, backend, device))[0]
        own = backend_defaults(name)
        if own.pair_drafter is not None and not serving and k != 0:
            if pull_missing or installed(own.draft) is not None:
                drafter, draft = own.pair_drafter, own.draft
            else:
                warnings.warn(f"the default draft '{own.draft}' is not installed: {own.drafter} drafts alone "
                              f"(`verispec models pull` installs it)", stacklevel=3)
        if drafter == "auto" and DRAFTERS[default_drafter(name, False)].needs_model:
            draft = DEFAULT_DRAFT
    elif default_pair and draft is None and drafter in DRAFTERS and DRAFTERS[drafter].needs_model:
        draft = DEFAULT_DRAFT
    _ensure_installed(draft, "draft.model", pull_missing)
    return target, draft, drafter


def _ensure_installed(ref: str | None, field_name: str, pull_missing: bool) -> None:
    if isinstance(ref, str) and ref in default_models() and installed(ref) is None:
        if not pull_missing:
            raise SpecError(f"the default model '{ref}' is not installed: run `verispec models pull`", field_name,
                            (("pull", True),), runtime=True)
        pull(ref)


def check_exact_kernels(target: TargetSpec, k: int | str | None) -> None:
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
