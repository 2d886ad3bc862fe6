"""llama.cpp backend (llama-cpp-python): GGUF models on llama.cpp's quantized CPU kernels.

A `LlamaCppModel` is the Model protocol over one llama.cpp context of `slots` sequences (seq ids). `forward_rows`
puts every row's tokens in one llama_batch, each at its sequence's own positions, with a logits flag on the
positions whose logits are kept, decodes it (in llama_decode calls of at most n_batch tokens) and copies those rows
out as float32; rollback removes a sequence's KV cells past the kept length (`llama_memory_seq_rm`), which is
exact: llama.cpp's cache is per position and nothing else carries state. A context of several slots is unified
(one pass over the weights for all rows, whatever their lengths) and places token p of sequence s in cell
p * slots + s (the patch's VERISPEC_KV_INTERLEAVE), so a sequence's cells keep the order of its positions, as when
it is alone. `with_slots(n)` opens another context on the same weights and parks the one-slot model's own (freed
until the model is used again: a batch server holds one context's memory, not two). llama.cpp works on host memory,
so token ids come to the host for every pass and logits go to `device` (the pipeline's device) once per call.

`make install-llamacpp` builds llama-cpp-python with verispec's kernel patch (native/llama.cpp-kernels.patch):
multi-column kernels that read each Q4_K/Q6_K weight block once for many tokens of a pass and compute every token
bitwise as a one-token pass would; flash attention on its one-row kernel for every row (no tiles, no split over
threads), so a row's attention does not depend on the rows beside it; and a batch-invariant mode in which every
pass gives bitwise the logits of its tokens' one-token passes whatever the weight types. So with Q4_K/Q6_K weights
(and with any weights in the exact mode) a sequence's logits are the same in any pass, alone or batched:
verification gives plain decoding's logits, and a batched request gets bitwise its output alone. `kernels()` says
which kernels this process runs; `LlamaCppModel.batch_invariant` whether that holds for a model.
"""

from __future__ import annotations

import ctypes
import functools
import os
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from verispec.backends.base import check_copy, check_rows
from verispec.backends.gguf import CONTEXT_STEP, available_memory, context_size
from verispec.catalog.gguf import gguf_metadata, matmul_weight_types
from verispec.names.errors import ModelError

N_BATCH = 512  # tokens per llama_decode call (a longer pass is split)
EXACT_WIDTH = N_BATCH  # the widest pass the batch-invariant kernels cover: every pass
ENV_EXACT = "VERISPEC_GGML_EXACT"  # the patch's process-wide switches, read when llama.cpp first computes
ENV_MULTICOL = "VERISPEC_GGML_MULTICOL"
ENV_MULTICOL_ISA = "VERISPEC_GGML_MULTICOL_ISA"  # "avx2": the kernels' AVX2 variant even where AVX512-VNNI is there
ENV_MULTICOL_SWEEP = "VERISPEC_GGML_MULTICOL_SWEEP"  # columns per sweep over the weights (0: all of a pass)
ENV_SPLIT_KV = "VERISPEC_GGML_FA_SPLIT_KV"
ENV_FA_TILED = "VERISPEC_GGML_FA_TILED"
ENV_KV_INTERLEAVE = "VERISPEC_KV_INTERLEAVE"
# verispec's defaults for those switches: every row's attention on the one-row kernel, and each sequence's cells in
# the order of its positions (see the module docstring); set before llama.cpp first computes
BATCH_INVARIANT_ENV = {ENV_SPLIT_KV: "0", ENV_FA_TILED: "0", ENV_KV_INTERLEAVE: "1"}
INVARIANT_TYPES = {12: "Q4_K", 14: "Q6_K"}  # GGUF weight types whose multi-column kernels are batch-invariant
# the features list's VERISPEC_MULTICOL value -> the instruction set of the kernels' variant ("1": a build that
# had only the AVX512-VNNI one)
MULTICOL_ISAS = {"1": "AVX512-VNNI", "AVX512_VNNI": "AVX512-VNNI", "AVX2": "AVX2"}
NO_MULTICOL = ("verispec's multi-column kernels do not run (switched off by VERISPEC_GGML_MULTICOL=0, or a CPU "
               "without AVX2, FMA and F16C)")
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
    by `make install-llamacpp`); `multicol`: the instruction set whose variant of verispec's multi-column kernels
    runs ("AVX512-VNNI" or "AVX2", the same bits; None: switched off, a CPU with neither, or a build not for x86);
    `amx`: llama.cpp's AMX kernels are; `exact`: the widest pass computed by batch-invariant kernels (0: none);
    `split_kv`: one-token flash attention splits long contexts across threads; `tiled_fa`: flash attention runs
    its tiled kernel for passes of many rows; `interleave`: a context of several sequences keeps each one's cells
    in the order of its positions."""

    build: str | None
    multicol: str | None
    amx: bool
    exact: int
    split_kv: bool = False
    tiled_fa: bool = False
    interleave: bool = True

    def variance(self, weight_types: Iterable[str] = ()) -> str | None:
        """Why a model with these matmul weight types (GGUF type names) may get different logits for a token in
        passes of different widths or with other sequences beside it; None: it never does (batch-invariant)."""
        if self.build is None:
            return "stock llama-cpp-python kernels round a token differently in passes of different widths"
        if self.split_kv or self.tiled_fa or not self.interleave:
            return "flash attention's kernel depends on the pass (split or tiled attention is switched on)"
        if self.exact:
            return None
        if self.amx:
            return "llama.cpp's AMX kernels round a token differently in passes of different widths"
        if not self.multicol:
            return NO_MULTICOL
        other = sorted(set(weight_types) - set(INVARIANT_TYPES.values()))
        if other:
            return (f"{', '.join(other)} weights run llama.cpp's own kernels, not made to compute a token alike in "
                    f"passes of every width (--exact-kernels makes them)")
        return None

    def describe(self, weight_types: Iterable[str] | None = None) -> str:
        """One line: which kernels verify a pass over a few tokens, and why; with a model's weight types, whether
        its tokens' logits are batch-invariant."""
        if self.build is None:
            line = ("stock llama-cpp-python kernels (built without verispec's patch: `make install-llamacpp` builds "
                    "the multi-column kernels that make verification cheaper)")
        elif self.multicol:
            line = (f"verispec's multi-column kernels ({self.multicol}): each Q4_K/Q6_K weight block read once for a "
                    f"whole pass")
        else:
            line = f"stock kernels: {NO_MULTICOL}"
        if self.amx:
            line += "; llama.cpp's AMX kernels"
        if self.exact:
            line += "; exact kernels for every weight type"
        if weight_types is not None:
            why = self.variance(weight_types)
            line += "; batch-invariant" if why is None else f"; not batch-invariant: {why}"
        return "llama.cpp: " + line


def _features() -> dict[str, str]:
    """llama.cpp's CPU features list (`llama_print_system_info`): name -> value."""
    info = import_llama_cpp().llama_print_system_info().decode(errors="replace")
    pairs = (item.split("=", 1) for item in info.replace("\n", "|").split("|") if "=" in item)
    return {name.strip().split(":")[-1].strip(): value.strip() for name, value in pairs}


def _switch(name: str) -> bool:
    return os.environ.get(name, BATCH_INVARIANT_ENV[name]) != "0"


def kernels() -> Kernels:
    """The kernels llama.cpp runs in this process (see Kernels)."""
    features = _features()
    build = features.get("VERISPEC_BUILD")
    if build is None:
        return Kernels(None, None, features.get("AMX_INT8") == "1", 0, True, True, False)
    exact = int(os.environ.get(ENV_EXACT) or 0)
    isa = MULTICOL_ISAS.get(features.get("VERISPEC_MULTICOL", ""))
    return Kernels(build, isa, features.get("AMX_INT8") == "1", exact, _switch(ENV_SPLIT_KV) and not exact,
                   _switch(ENV_FA_TILED), _switch(ENV_KV_INTERLEAVE))


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


def open_llama(path: str, n_ctx: int = 0, n_threads: int | None = None, n_batch: int = N_BATCH,
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
    for name, value in BATCH_INVARIANT_ENV.items():  # see the module docstring; read when llama.cpp first computes
        os.environ.setdefault(name, value)
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


def _reopen(llama) -> None:
    """A new, empty context for a Llama whose own was closed (LlamaCppModel.park), with the same parameters;
    ModelError when llama.cpp cannot open it (e.g. out of memory)."""
    from llama_cpp._internals import LlamaContext

    try:
        llama._ctx = LlamaContext(model=llama._model, params=llama.context_params, verbose=False)
    except ValueError as exc:
        raise ModelError(f"llama.cpp cannot reopen the context of {llama.context_params.n_ctx} tokens: {exc}") from exc
    llama.n_tokens = 0


class LlamaCppModel:
    """The Model protocol over a llama.cpp context of `slots` sequences. `device` is where logits are returned;
    `n_ctx` the context of each sequence in tokens (None: context_size's rule, from the file's metadata and the
    available memory); `exact_kernels`: see use_exact_kernels; `flash_attn` False: llama.cpp's attention without
    flash attention, whose one-token and multi-token passes round differently (for measurements)."""

    def __init__(self, path: str, device: torch.device = torch.device("cpu"), n_ctx: int | None = None,
                 n_threads: int | None = None, n_batch: int = N_BATCH, exact_kernels: bool = False,
                 flash_attn: bool = True, slots: int = 1) -> None:
        llama_cpp = import_llama_cpp()
        if exact_kernels:
            use_exact_kernels()
        if n_ctx is None:
            n_ctx = context_size(gguf_metadata(path), available_memory(), slots=slots)
        self._llama = open_llama(path, n_ctx=n_ctx, n_threads=n_threads, n_batch=n_batch, gpu=device.type == "cuda",
                                 flash_attn=flash_attn)
        self._open(llama_cpp, path, device, slots, n_ctx)

    def _open(self, llama_cpp, path: str, device: torch.device, slots: int, n_ctx: int) -> None:
        """Take the Llama's own context (one slot), or open one of `slots` sequences of n_ctx tokens each on its
        weights."""
        self._lib, self.path, self.device, self.slots = llama_cpp, path, device, slots
        self._context = None
        if slots > 1:
            from llama_cpp._internals import LlamaContext

            params = llama_cpp.llama_context_params.from_buffer_copy(self._llama.context_params)
            params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx * slots, slots, True
            try:
                self._context = LlamaContext(model=self._llama._model, params=params, verbose=False)
            except ValueError as exc:
                raise ModelError(f"llama.cpp cannot open a context of {slots} sequences x {n_ctx} tokens for "
                                 f"'{path}': {exc}") from exc
        self.vocab_size = int(self._llama.n_vocab())
        ctx = self._live()
        self.max_length = int(self._lib.llama_n_ctx(ctx)) // slots
        self.n_batch = int(self._lib.llama_n_batch(ctx))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._seq = list(range(slots))  # slot -> its llama.cpp sequence id (swap exchanges them)
        self.lengths = [0] * slots
        self.reset()

    @property
    def _ctx(self):
        """The llama.cpp context: this model's own (several slots) or the Llama's (one slot; None while parked)."""
        return (self._context if self.slots > 1 else self._llama._ctx).ctx

    def with_slots(self, slots: int) -> LlamaCppModel:
        """A context of `slots` sequences on the same weights, sharing this one's context as llama-server's slots
        share its -c: each sequence holds max_length // slots tokens (a multiple of CONTEXT_STEP, at least one). So
        the batch's KV cache takes this context's memory, and the context llama.cpp sees is the one this model was
        opened with (positional encodings that depend on it stay the same). A one-slot model is parked meanwhile
        (see park), first, so that the batch's cache can take its memory: a server decoding in the batch holds no
        idle cache of the whole context beside it."""
        n_ctx = max(CONTEXT_STEP, self.max_length // slots // CONTEXT_STEP * CONTEXT_STEP)
        self.park()
        model = LlamaCppModel.__new__(LlamaCppModel)
        model._llama = self._llama
        model._open(self._lib, self.path, self.device, slots, n_ctx)
        return model

    def park(self) -> None:
        """Free a one-slot model's llama.cpp context (the Llama's own: its KV cache of max_length tokens and its
        compute buffers) until the model, or its Llama (`llm`), is used again, when an empty one opens with the
        same parameters. Its cache is dropped (lengths 0), which the engine reads as nothing cached. No-op for a
        context of several slots, or one already parked."""
        if self.slots == 1 and not self.parked:
            self._llama._ctx.close()
            self.lengths[:] = [0]

    @property
    def parked(self) -> bool:
        """Whether the model's llama.cpp context is freed (see park) until its next use."""
        return self._ctx is None

    @property
    def llm(self):
        """The llama_cpp.Llama, for llama-cpp-python's own calls: its own context open (reopened, empty, if
        parked)."""
        if self._llama._ctx.ctx is None:
            _reopen(self._llama)
        return self._llama

    def _live(self):
        """The llama.cpp context, reopened (empty) if parked."""
        if self.parked:
            _reopen(self._llama)
        return self._ctx

    @functools.cached_property
    def weight_types(self) -> set[str]:
        """The types of the model's matrix-multiplied weights (see matmul_weight_types)."""
        return matmul_weight_types(self.path)

    @property
    def batch_invariant(self) -> bool:
        """Whether a token's logits are the same in every pass, whatever its width and the rows beside it."""
        return kernels().variance(self.weight_types) is None

    def __del__(self) -> None:
        batch, self._batch = getattr(self, "_batch", None), None
        if batch is not None:
            self._lib.llama_batch_free(batch)

    def forward_rows(self, slots: list[int], feeds: list[torch.Tensor], last_only: bool = False,
                     logits_for: list[int] | None = None) -> list[torch.Tensor]:
        """Every row's tokens in one llama_batch (split into llama_decode calls of at most n_batch tokens), each at
        its sequence's positions; the logits of each row's last logits_for[b] tokens [logits_for[b], V], float32 on
        self.device."""
        logits_for = check_rows(self, slots, feeds, last_only, logits_for)
        rows = [feed.tolist() for feed in feeds]  # the pass's one device -> host copy of its tokens
        if min(min(ids) for ids in rows) < 0 or max(max(ids) for ids in rows) >= self.vocab_size:
            raise ValueError(f"a token id is out of range for the vocabulary of {self.vocab_size}")
        tokens = [(self._seq[slot], self.lengths[slot] + j, token, j >= len(ids) - k)
                  for slot, ids, k in zip(slots, rows, logits_for) for j, token in enumerate(ids)]
        out = [self._decode(tokens[at : at + self.n_batch], slots) for at in range(0, len(tokens), self.n_batch)]
        for slot, ids in zip(slots, rows):
            self.lengths[slot] += len(ids)
        logits = torch.from_numpy(out[0] if len(out) == 1 else np.concatenate(out)).to(self.device, non_blocking=True)
        return list(logits.split(logits_for))

    def _decode(self, tokens: list[tuple[int, int, int, bool]], slots: list[int]) -> np.ndarray:
        """Decode one llama_batch of (sequence, position, token, wants logits); the logits of the flagged tokens,
        in batch order. A failed decode may leave some cells written: every row's cells past its held length go."""
        b = self._batch
        b.n_tokens = len(tokens)
        for i, (seq, pos, token, wanted) in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, wanted
            b.seq_id[i][0] = seq
        status = self._lib.llama_decode(self._live(), b)
        if status != 0:
            for slot in slots:
                self._remove_from(slot, self.lengths[slot])
            raise RuntimeError(f"llama_decode failed with status {status}")
        rows = sum(wanted for *_, wanted in tokens)
        if not rows:
            return np.empty((0, self.vocab_size), dtype=np.float32)
        ptr = self._lib.llama_get_logits(self._ctx)
        flat = np.ctypeslib.as_array(ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(rows * self.vocab_size,))
        return flat.reshape(rows, self.vocab_size).copy()

    def _remove_from(self, slot: int, position: int) -> None:
        if self.parked:  # nothing held
            return
        memory = self._lib.llama_get_memory(self._ctx)
        if not self._lib.llama_memory_seq_rm(memory, self._seq[slot], position, -1):
            raise RuntimeError(f"llama.cpp could not remove cache cells from position {position}")

    def rollback(self, slot: int, length: int) -> None:
        held = self.lengths[slot]
        if not 0 <= length <= held:
            raise ValueError(f"cannot roll back to {length}: cache holds {held}")
        if length < held:
            self._remove_from(slot, length)
            self.lengths[slot] = length

    def swap(self, a: int, b: int) -> None:
        """Slots a and b exchange their sequences: an O(1) swap of sequence ids (the cells stay where they are,
        in the order of their positions)."""
        self._seq[a], self._seq[b] = self._seq[b], self._seq[a]
        self.lengths[a], self.lengths[b] = self.lengths[b], self.lengths[a]

    def copy(self, src: int, dst: int, length: int) -> None:
        """Slot dst's cache becomes the first `length` positions of src's: src's sequence state (its cells' keys
        and values, bit for bit) read out and written into dst's cells, then rolled back to `length`."""
        check_copy(self, src, dst, length)
        ctx = self._live()
        size = int(self._lib.llama_state_seq_get_size(ctx, self._seq[src]))
        data = (ctypes.c_uint8 * size)()
        size = int(self._lib.llama_state_seq_get_data(ctx, data, size, self._seq[src]))
        if not self._lib.llama_state_seq_set_data(ctx, data, size, self._seq[dst]):
            self.lengths[dst] = 0
            raise RuntimeError(f"llama.cpp could not copy slot {src}'s cache into slot {dst}")
        self.lengths[dst] = self.lengths[src]
        self.rollback(dst, length)

    def reset(self, slot: int | None = None) -> None:
        if slot is None:
            if not self.parked:
                self._lib.llama_memory_clear(self._lib.llama_get_memory(self._ctx), True)
            self.lengths[:] = [0] * self.slots
        else:
            self._remove_from(slot, 0)
            self.lengths[slot] = 0
