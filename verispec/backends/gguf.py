"""The context a GGUF model's KV cache affords in the available memory (llama.cpp's context for a model, chosen
from its header's metadata, verispec.catalog.gguf, before it is opened)."""

from __future__ import annotations

import os
from collections.abc import Mapping

KV_MEMORY_SHARE = 0.25  # the most of the available memory one model's KV cache may take
CONTEXT_STEP = 256  # a context chosen from memory is a multiple of this (and at least this)
KV_BYTES_PER_VALUE = 2  # llama.cpp's default KV cache type is f16


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
