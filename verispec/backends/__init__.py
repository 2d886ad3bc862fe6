from verispec.backends.base import Model, SlotModel, TreeModel, common_prefix_length
from verispec.backends.hf import HFModel

__all__ = ["Model", "HFModel", "SlotModel", "TreeModel", "common_prefix_length"]
