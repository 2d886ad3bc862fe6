from verispec.backends.base import Model, common_prefix_length
from verispec.backends.hf import HFModel

__all__ = ["Model", "HFModel", "common_prefix_length"]
