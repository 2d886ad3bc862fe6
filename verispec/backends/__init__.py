"""Models and their KV caches. `HFModel` (transformers) is imported on first use, so that the interfaces in
base.py, and what is built on them, load without transformers."""

import importlib

from verispec.backends.base import Model, Sequence, TreeModel, common_prefix_length


def __getattr__(name: str):
    if name == "HFModel":
        return importlib.import_module("verispec.backends.hf").HFModel
    raise AttributeError(f"module 'verispec.backends' has no attribute {name!r}")


__all__ = ["Model", "HFModel", "Sequence", "TreeModel", "common_prefix_length"]
