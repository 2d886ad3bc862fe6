"""llama.cpp backend (llama-cpp-python): GGUF models on llama.cpp's quantized CPU kernels.

One llama.cpp context per model, one sequence (seq_id 0). `forward` builds a llama_batch with a logits
flag on every new position (or only the last), decodes it and copies those rows out as float32; rollback
removes the KV cells past the kept length (`llama_memory_seq_rm`), which is exact: llama.cpp's cache is
per-position and nothing else carries state. llama.cpp works on host memory, so token ids come to the
host for every forward and logits go to `device` (the pipeline's device) once per call.
"""

from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

from verispec.models import ModelError

INSTALL_HINT = "the llama.cpp backend needs llama-cpp-python: pip install -e '.[llamacpp]' (it builds llama.cpp, ~6 min)"


def import_llama_cpp():
    """The llama_cpp module, or a ModelError that says how to install it."""
    try:
        import llama_cpp
    except ImportError as exc:
        raise ModelError(INSTALL_HINT) from exc
    return llama_cpp


def default_threads() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def open_llama(path: str, n_ctx: int = 0, n_threads: int | None = None, n_batch: int = 512,
               gpu: bool = False, **kwargs):
    """A llama_cpp.Llama on `path` with verispec's defaults: every core for decode and batch, quiet, and
    flash attention on. Measured here: without flash attention llama.cpp's K*Q product gives different
    logits for a token evaluated alone and the same token inside a batch (SmolLM2: up to 1.25), which
    makes greedy verification disagree with plain decoding; with it, batches of up to 7 tokens reproduce
    single-token evaluation bitwise on SmolLM2 (on the Qwen GGUFs up to ~4e-5 from the repacked Q4_K
    kernels for 4+ rows, and ~0.1 from 8 rows on)."""
    llama_cpp = import_llama_cpp()
    threads = n_threads or default_threads()
    try:
        return llama_cpp.Llama(
            model_path=path, n_ctx=n_ctx, n_batch=n_batch, n_ubatch=n_batch, n_threads=threads,
            n_threads_batch=threads, n_gpu_layers=-1 if gpu else 0, verbose=False,
            **{"flash_attn": True, **kwargs},
        )
    except (ValueError, RuntimeError) as exc:  # llama-cpp-python raises ValueError for a file it cannot load
        raise ModelError(f"llama.cpp cannot load '{path}': {exc}") from exc


class LlamaCppModel:
    """The Model protocol over a llama.cpp context. `device` is where logits are returned."""

    def __init__(self, path: str, device: torch.device = torch.device("cpu"), n_ctx: int = 8192,
                 n_threads: int | None = None, n_batch: int = 512) -> None:
        self.path = path
        llama_cpp = import_llama_cpp()
        self._lib = llama_cpp
        self.llm = open_llama(path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, gpu=device.type == "cuda")
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
