"""GGUF headers read without llama.cpp or gguf's reader: the key-value metadata (the tokenizer's long arrays skipped
unread) and the types of the matrix-multiplied weights. Torch-free, so that the catalog can read a file it pulled."""

from __future__ import annotations

import struct

from verispec.names.errors import ModelError

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
