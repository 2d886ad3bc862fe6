"""Models and their KV caches. `HFModel` (transformers) is imported on first use, so that the interfaces in
base.py, and what is built on them, load without transformers (whose model code takes seconds to import: a
llama.cpp pipeline never needs it)."""

import importlib
import sys

from verispec.backends.base import Model, Sequence, TreeModel, common_prefix_length


def __getattr__(name: str):
    if name == "HFModel":
        return importlib.import_module("verispec.backends.hf").HFModel
    raise AttributeError(f"module 'verispec.backends' has no attribute {name!r}")


def is_hf_model(model: object) -> bool:
    """Whether `model` is an HFModel, without importing transformers to find out: none exists before
    verispec.backends.hf is imported."""
    hf = sys.modules.get("verispec.backends.hf")
    return hf is not None and isinstance(model, hf.HFModel)


__all__ = ["Model", "HFModel", "Sequence", "TreeModel", "common_prefix_length", "is_hf_model"]
