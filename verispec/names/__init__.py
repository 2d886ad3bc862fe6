"""Layer 0, torch-free: the names everything else shares (models, drafters and their sources, k's defaults and
checks, the errors), and the model cache."""

__version__ = "0.1.0"
