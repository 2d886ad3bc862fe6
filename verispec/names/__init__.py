"""Layer 0, torch-free: the names everything else shares (the sampling options' declarations, drafters and their
sources, k's defaults and checks, the errors). The models and their cache are the catalog's, one layer up."""

__version__ = "0.1.0"
