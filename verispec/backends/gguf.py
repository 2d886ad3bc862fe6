"""GGUF files read without llama.cpp: a header's key-value metadata, the types of the matrix-multiplied weights,
and the context a model's KV cache affords in the available memory (llama.cpp's context for a model, chosen before
it is opened)."""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping

from verispec.names.errors import ModelError

KV_MEMORY_SHARE = 0.25  # the most of the available memory one model's KV cache may take
CONTEXT_STEP = 256  # a context chosen from memory is a multiple of this (and at least this)
KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type is f16

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


def _value(buf, at: int, kind: int, wanted: bool) -> tuple[object, int]:
    """(the GGUF value of type `kind` at offset `at`, the offset after it); strings and arrays not kept
    are skipped over (None)."""
    if kind in _SCALARS:
        fmt = _SCALARS[kind]
        return struct.unpack_from(fmt, buf, at)[0], at + struct.calcsize(fmt)
    if kind == _STRING:
        n = struct.unpack_from("<Q", buf, at)[0]
        return (bytes(buf[at + 8 : at + 8 + n]).decode("utf-8", "replace") if wanted else None), at + 8 + n
    if kind == _ARRAY:
        item, count = struct.unpack_from("<IQ", buf, at)
        at += 12
        if item in _SCALARS and not wanted:
            return None, at + count * struct.calcsize(_SCALARS[item])
        values = []
        for _ in range(count):
            value, at = _value(buf, at, item, wanted)
            values.append(value)
        return (values if wanted else None), at
    raise ValueError(f"unknown GGUF value type {kind}")


GGUF_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 10: "Q2_K", 11: "Q3_K",
              12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 30: "BF16"}


def _read_gguf(path: str, tensors: bool = False) -> tuple[dict[str, object], list[tuple[str, list[int], int]]]:
    """The GGUF header's key-value metadata, less the tokenizer's (long arrays, skipped unread), and with
    `tensors` each tensor's (name, dims, type id)."""
    import mmap

    meta: dict[str, object] = {}
    infos: list[tuple[str, list[int], int]] = []
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        if buf[:4] != b"GGUF":
            raise ModelError(f"'{path}' is not a GGUF file")
        version, n_tensors, count = struct.unpack_from("<IQQ", buf, 4)
        if version < 2:
            raise ModelError(f"'{path}' is a GGUF version {version} file; version 2 or later is needed")
        at = 24
        for _ in range(count):
            key, at = _value(buf, at, _STRING, wanted=True)
            kind = struct.unpack_from("<I", buf, at)[0]
            value, at = _value(buf, at + 4, kind, wanted=not key.startswith("tokenizer."))
            if value is not None:
                meta[key] = value
        for _ in range(n_tensors if tensors else 0):
            name, at = _value(buf, at, _STRING, wanted=True)
            n_dims = struct.unpack_from("<I", buf, at)[0]
            dims = list(struct.unpack_from(f"<{n_dims}Q", buf, at + 4))
            kind = struct.unpack_from("<I", buf, at + 4 + 8 * n_dims)[0]
            infos.append((name, dims, kind))
            at += 4 + 8 * n_dims + 4 + 8
    return meta, infos


def gguf_metadata(path: str) -> dict[str, object]:
    """The GGUF header's key-value metadata, less the tokenizer's (long arrays, skipped unread)."""
    return _read_gguf(path)[0]


def matmul_weight_types(path: str) -> set[str]:
    """The types of a GGUF's matrix-multiplied weights (2-D tensors but the token embedding, which is only looked
    up unless the file has no output matrix): their names in GGUF_TYPES, Q4_K that llama.cpp cannot repack (rows
    not a multiple of 8) as 'Q4_K (not repacked)'."""
    infos = _read_gguf(path, tensors=True)[1]
    tied = not any(name == "output.weight" for name, _, _ in infos)
    types = set()
    for name, dims, kind in infos:
        if len(dims) != 2 or (name == "token_embd.weight" and not tied):
            continue
        label = GGUF_TYPES.get(kind, f"type {kind}")
        types.add("Q4_K (not repacked)" if label == "Q4_K" and dims[1] % 8 else label)
    return types


# -- the context size ---------------------------------------------------------------------------------


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


def context_size(meta: Mapping[str, object], available: int | None, requested: int | None = None,
                 slots: int = 1) -> int:
    """llama.cpp's context per sequence for a model whose context holds `slots` sequences: `requested` when given;
    else the model's trained context (its GGUF `context_length`), lowered when the KV cache of all slots would take
    more than KV_MEMORY_SHARE of the `available` memory (bytes; None: unknown, no bound), to a multiple of
    CONTEXT_STEP tokens and never below one step. The share leaves room for the weights, a second model and the
    rest of the process."""
    if requested is not None:
        return requested
    trained = int(meta[f"{meta['general.architecture']}.context_length"])
    if available is None:
        return trained
    fits = int(available * KV_MEMORY_SHARE) // (kv_bytes_per_token(meta) * slots)
    return max(CONTEXT_STEP, min(trained, fits // CONTEXT_STEP * CONTEXT_STEP))
