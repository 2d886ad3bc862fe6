"""llama.cpp backend (llama-cpp-python): GGUF models on llama.cpp's quantized CPU kernels.

One llama.cpp context per model, one sequence (seq_id 0). `forward` builds a llama_batch with a logits
flag on every new position (or only the last), decodes it and copies those rows out as float32; rollback
removes the KV cells past the kept length (`llama_memory_seq_rm`), which is exact: llama.cpp's cache is
per-position and nothing else carries state. llama.cpp works on host memory, so token ids come to the
host for every forward and logits go to `device` (the pipeline's device) once per call.

`make install-llamacpp` builds llama-cpp-python with verispec's kernel patch (native/llama.cpp-kernels.patch):
multi-column kernels that read each Q4_K/Q6_K weight block once for up to a dozen tokens of a pass and compute
every token bitwise as a one-token pass would; and a batch-invariant mode in which a pass over n <= EXACT_WIDTH tokens gives
bitwise the logits of n one-token passes whatever the weight types. One-token flash attention is not split across
threads over long contexts (the split sums the context in another order than a wider pass; on a few cores it
saves nothing measurable), so with Q4_K/Q6_K weights verification gives plain decoding's logits by default.
`kernels()` says which kernels this process runs.
"""

from __future__ import annotations

import ctypes
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from verispec.names.errors import ModelError

EXACT_WIDTH = 16  # the widest pass the batch-invariant kernels cover: k + 1 tokens, so k <= 15
ENV_EXACT = "VERISPEC_GGML_EXACT"  # the patch's process-wide switches, read when llama.cpp first computes
ENV_MULTICOL = "VERISPEC_GGML_MULTICOL"
ENV_SPLIT_KV = "VERISPEC_GGML_FA_SPLIT_KV"
KV_MEMORY_SHARE = 0.25  # the most of the available memory one model's KV cache may take
CONTEXT_STEP = 256  # a context chosen from memory is a multiple of this (and at least this)
KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type is f16
INSTALL_HINT = "the llama.cpp backend needs llama-cpp-python: pip install -e '.[llamacpp]' (it builds llama.cpp, ~6 min)"


def import_llama_cpp():
    """The llama_cpp module, or a ModelError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        if exc.name == "llama_cpp":
            raise ModelError(INSTALL_HINT) from exc
        raise ModelError(f"llama-cpp-python is installed but does not import ({exc}): reinstall it with "
                         f"`make install-llamacpp`") from exc
    return llama_cpp


# -- the kernels ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Kernels:
    """The llama.cpp kernels of this process. `build`: verispec's build key (None: llama-cpp-python was not built
    by `make install-llamacpp`); `multicol`: verispec's multi-column kernels are compiled in (x86 with AVX512-VNNI);
    `amx`: llama.cpp's AMX kernels are; `exact`: the widest pass computed by batch-invariant kernels (0: none);
    `split_kv`: one-token flash attention splits long contexts across threads."""

    build: str | None
    multicol: bool
    amx: bool
    exact: int
    split_kv: bool = False

    def describe(self) -> str:
        """One line: which kernels verify a pass over a few tokens, and why."""
        if self.build is None:
            line = ("stock llama-cpp-python kernels (built without verispec's patch: `make install-llamacpp` builds "
                    "the multi-column kernels that make verification cheaper)")
        elif self.multicol:
            line = ("verispec's multi-column kernels (AVX512-VNNI): each Q4_K/Q6_K weight block read once for up to a "
                    "dozen tokens of a pass")
        else:
            line = "stock kernels: this CPU lacks AVX512-VNNI, which verispec's multi-column kernels need"
        if self.amx:
            line += "; llama.cpp's AMX kernels"
        if self.exact:
            line += f"; batch-invariant up to {self.exact} tokens (exact kernels)"
        elif self.split_kv:
            line += "; one-token attention split across threads (verification can round differently)"
        return "llama.cpp: " + line


def _features() -> dict[str, str]:
    """llama.cpp's CPU features list (`llama_print_system_info`): name -> value."""
    info = import_llama_cpp().llama_print_system_info().decode(errors="replace")
    pairs = (item.split("=", 1) for item in info.replace("\n", "|").split("|") if "=" in item)
    return {name.strip().split(":")[-1].strip(): value.strip() for name, value in pairs}


def kernels() -> Kernels:
    """The kernels llama.cpp runs in this process (see Kernels)."""
    features = _features()
    build = features.get("VERISPEC_BUILD")
    exact = int(os.environ.get(ENV_EXACT) or 0) if build is not None else 0
    split_kv = build is None or os.environ.get(ENV_SPLIT_KV, "0") != "0"
    return Kernels(build, features.get("VERISPEC_MULTICOL") == "1", features.get("AMX_INT8") == "1", exact, split_kv)


_opened = False  # a llama.cpp model was opened in this process: it may have computed, its switches read


def use_exact_kernels() -> None:
    """Make every llama.cpp pass of up to EXACT_WIDTH tokens in this process batch-invariant (an n-token pass
    gives bitwise the logits of n one-token passes). The switch is process-wide and read once, when llama.cpp
    first computes, so it must come before this process opens any llama.cpp model."""
    if kernels().build is None:
        raise ModelError("exact kernels need llama-cpp-python built with verispec's patch (`make install-llamacpp`)")
    if os.environ.get(ENV_EXACT) == str(EXACT_WIDTH):
        return
    if _opened:
        raise ModelError("exact kernels must be chosen before the first llama.cpp model of this process is opened "
                         "(llama.cpp reads its kernel switches once)")
    os.environ[ENV_EXACT] = str(EXACT_WIDTH)


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def open_llama(path: str, n_ctx: int = 0, n_threads: int | None = None, n_batch: int = 512,
               gpu: bool = False, **kwargs):
    """A llama_cpp.Llama on `path` with verispec's defaults: every core for decode and batch, quiet, and
    flash attention on. Without flash attention llama.cpp's K*Q product gives different logits for a token
    evaluated alone and the same token inside a batch, which makes greedy verification disagree with plain
    decoding; with it, small batches reproduce single-token evaluation bitwise on SmolLM2, and on the Qwen
    GGUFs the repacked Q4_K kernels still round multi-row batches slightly differently (tests/test_llamacpp.py
    checks the identity)."""
    global _opened
    llama_cpp = import_llama_cpp()
    threads = n_threads or default_threads()
    os.environ.setdefault(ENV_SPLIT_KV, "0")  # see the module docstring; read when llama.cpp first computes
    _opened = True
    try:
        return llama_cpp.Llama(
            model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=-1 if gpu else 0, verbose=False,
            **{"flash_attn": True, **kwargs},
        )
    except (ValueError, RuntimeError) as exc:  # llama-cpp-python raises ValueError for a file it cannot load
        raise ModelError(f"llama.cpp cannot load '{path}': {exc}") from exc


def eog_ids_of_gguf(path: str) -> list[int]:
    """The token ids llama.cpp ends generation at for a GGUF (`llama_vocab_is_eog`), from its vocabulary
    alone (no weights loaded). verispec.backends.loading.eog_token_ids reproduces llama.cpp's rule for every backend;
    this is what it is checked against."""
    llama_cpp = import_llama_cpp()
    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(path.encode(), params)
    if not model:
        raise ModelError(f"llama.cpp cannot load the vocabulary of '{path}'")
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        return [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    finally:
        llama_cpp.llama_model_free(model)


# -- the context size ---------------------------------------------------------------------------------

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _value(buf, at: int, kind: int, keep: bool) -> tuple[object, int]:
    """(the GGUF value of type `kind` at offset `at`, the offset after it); strings and arrays not kept
    are skipped over (None)."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
    if kind == _STRING:
        n = struct.unpack_from("<Q", buf, at)[0]
        return (bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace") if keep else None), at + 8 + n
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item in _SCALARS and not keep:
            return None, at + count * struct.calcsize(_SCALARS[item])
        values = []
        for _ in range(count):
            value, at = _value(buf, at, item, keep)
            values.append(value)
        return (values if keep else None), at
    raise ValueError(f"unknown GGUF value type {kind}")


def gguf_metadata(path: str) -> dict[str, object]:
    """The GGUF header's key-value metadata, less the tokenizer's (long arrays, skipped unread)."""
    import mmap

    meta: dict[str, object] = {}
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelError(f"'{path}' is not a GGUF file")
        version, _, count = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ModelError(f"'{path}' is a GGUF version {version} file; version 2 or later is needed")
        at = 24
        for _ in range(count):
            key, at = _value(buf, at, _STRING, keep=True)
            kind = struct.unpack_from("<I", buf, at)[0]
            value, at = _value(buf, at + 4, kind, keep=not key.startswith("tokenizer."))
            if value is not None:
                meta[key] = value
    return meta


def kv_bytes_per_token(meta: Mapping[str, object]) -> int:
    """Bytes of KV cache per token: over the layers, KV heads x (key + value head size) x 2 bytes (f16), from
    the GGUF metadata (head sizes default to embedding_length / head_count; per-layer head counts are summed)."""
    arch = meta["general.architecture"]

    def per_layer(value) -> list[int]:  # a count for every layer, or one for all of them
        return [int(v) for v in value] if isinstance(value, list) else [int(value)] * int(meta[f"{arch}.block_count"])

    heads = per_layer(meta[f"{arch}.attention.head_count"])
    kv_heads = per_layer(meta.get(f"{arch}.attention.head_count_kv", meta[f"{arch}.attention.head_count"]))
    head_dim = int(meta[f"{arch}.embedding_length"]) // max(heads)
    key = int(meta.get(f"{arch}.attention.key_length", head_dim))
    value = int(meta.get(f"{arch}.attention.value_length", head_dim))
    return sum(kv_heads) * (key + value) * KV_BYTES_PER_VALUE


def available_memory() -> int | None:
    """Bytes of memory available to new allocations (Linux: MemAvailable), None when unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def context_size(meta: Mapping[str, object], available: int | None, requested: int | None = None) -> int:
    """llama.cpp's n_ctx for a model: `requested` when given; else the model's trained context (its GGUF
    `context_length`), lowered when its KV cache would take more than KV_MEMORY_SHARE of the `available`
    memory (bytes; None: unknown, no bound), to a multiple of CONTEXT_STEP tokens and never below one step.
    The share leaves room for the weights, a second model and the rest of the process."""
    if requested is not None:
        return requested
    trained = int(meta[f"{meta['general.architecture']}.context_length"])
    if available is None:
        return trained
    fits = int(available * KV_MEMORY_SHARE) // kv_bytes_per_token(meta)
    return max(CONTEXT_STEP, min(trained, fits // CONTEXT_STEP * CONTEXT_STEP))


class LlamaCppModel:
    """The Model protocol over a llama.cpp context. `device` is where logits are returned; `n_ctx` the
    context in tokens (None: context_size's rule, from the file's metadata and the available memory);
    `exact_kernels`: see use_exact_kernels; `flash_attn` False: llama.cpp's attention without flash attention,
    whose one-token and multi-token passes round differently (for measurements)."""

    def __init__(self, path: str, device: torch.device = torch.device("cpu"), n_ctx: int | None = None,
                 n_threads: int | None = None, n_batch: int = 512, exact_kernels: bool = False,
                 flash_attn: bool = True) -> None:
        self.path = path
        llama_cpp = import_llama_cpp()
        self._lib = llama_cpp
        if exact_kernels:
            use_exact_kernels()
        if n_ctx is None:
            n_ctx = context_size(gguf_metadata(path), available_memory())
        self.llm = open_llama(path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, gpu=device.type == "cuda",
                              flash_attn=flash_attn)
        self.device = device
        self.vocab_size = int(self.llm.n_vocab())
        self.max_length = int(self.llm.n_ctx())
        self.n_batch = int(self.llm.n_batch)
        self._ctx = self.llm._ctx.ctx  # the llama_context pointer
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._length = 0
        self.reset()

    def __del__(self) -> None:
        batch, self._batch = getattr(self, "_batch", None), None
        if batch is not None:
            self._lib.llama_batch_free(batch)

    @property
    def length(self) -> int:
        return self._length

    def _decode(self, ids: list[int], all_logits: bool) -> int:
        """Decode one batch (<= n_batch tokens) at positions _length...; returns rows of logits produced."""
        b = self._batch
        n = len(ids)
        b.n_tokens = n
        for i, token in enumerate(ids):
            b.token[i] = token
            b.pos[i] = self._length + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits
        b.logits[n - 1] = True
        status = self._lib.llama_decode(self._ctx, b)
        if status != 0:
            # a failed decode may leave some cells written: drop everything past the committed length
            self._remove_from(self._length)
            raise RuntimeError(f"llama_decode failed with status {status}")
        self._length += n
        return n if all_logits else 1

    def _logits(self, rows: int) -> np.ndarray:
        ptr = self._lib.llama_get_logits(self._ctx)
        flat = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(rows * self.vocab_size,))
        return flat.reshape(rows, self.vocab_size).copy()

    def forward(self, tokens: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """tokens: [n] -> logits [n, V] (or [1, V] with last_only), float32 on self.device."""
        ids = tokens.tolist()
        n = len(ids)
        if n == 0:
            raise ValueError("forward needs at least one token")
        if self._length + n > self.max_length:
            raise ValueError(f"sequence of {self._length + n} tokens exceeds the context of {self.max_length} "
                             f"(llama.cpp n_ctx)")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            raise ValueError(f"a token id is out of range for the vocabulary of {self.vocab_size}")
        out: list[np.ndarray] = []
        for start in range(0, n, self.n_batch):
            chunk = ids[start : start + self.n_batch]
            last_chunk = start + self.n_batch >= n
            rows = self._decode(chunk, all_logits=not last_only)
            if not last_only or last_chunk:
                out.append(self._logits(rows))
        logits = torch.from_numpy(out[0] if len(out) == 1 else np.concatenate(out))
        return logits.to(self.device, non_blocking=True)

    def _remove_from(self, position: int) -> None:
        memory = self._lib.llama_get_memory(self._ctx)
        if not self._lib.llama_memory_seq_rm(memory, 0, position, -1):
            raise RuntimeError(f"llama.cpp could not remove cache cells from position {position}")

    def rollback(self, length: int) -> None:
        if not 0 <= length <= self._length:
            raise ValueError(f"cannot roll back to {length}: cache holds {self._length}")
        if length < self._length:
            self._remove_from(length)
            self._length = length

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)
        self._length = 0

