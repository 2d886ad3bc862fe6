"""verispec: lossless speculative decoding for Hugging Face causal language models.

    pipe = verispec.load()  # the default pair; or names, paths, GGUF files, loaded transformers models
    print(pipe.generate("def fibonacci(n):", max_new_tokens=64).text)
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from verispec.core.sampling import SamplingParams
from verispec.decoding.engine import GenerationResult, SpeculativeEngine
from verispec.decoding.stats import SpecStats
from verispec.names import __version__

if TYPE_CHECKING:
    from verispec.apps.chat import ChatBot
    from verispec.assembly.build import build, load
    from verispec.assembly.specs import DraftSpec, TargetSpec
    from verispec.assembly.store import ModelStore
    from verispec.decoding.request import Request
    from verispec.names.errors import ModelError, SpecError
    from verispec.pipeline.pipeline import Completion, Pipeline, TextStream

# imported on first use: they bring in transformers, which the command line's light paths do without
_LAZY = {
    "DraftSpec": "verispec.assembly.specs", "ModelStore": "verispec.assembly.store",
    "TargetSpec": "verispec.assembly.specs", "build": "verispec.assembly.build", "load": "verispec.assembly.build",
    "ChatBot": "verispec.apps.chat", "ModelError": "verispec.names.errors", "SpecError": "verispec.names.errors",
    "Completion": "verispec.pipeline.pipeline", "Pipeline": "verispec.pipeline.pipeline",
    "TextStream": "verispec.pipeline.pipeline", "Request": "verispec.decoding.request",
}


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'verispec' has no attribute {name!r}")


__all__ = [
    "ChatBot", "Completion", "DraftSpec", "GenerationResult", "ModelError", "ModelStore", "Pipeline", "Request",
    "SamplingParams", "SpecError", "SpecStats", "SpeculativeEngine", "TargetSpec", "TextStream", "__version__", "build",
    "load",
]
