"""verispec: lossless speculative decoding for Hugging Face causal language models."""

from verispec.engine import GenerationResult, SpeculativeGenerator
from verispec.metrics import SpecStats
from verispec.sampling import SamplingParams

__version__ = "0.1.0"

__all__ = ["GenerationResult", "SamplingParams", "SpecStats", "SpeculativeGenerator", "__version__"]
