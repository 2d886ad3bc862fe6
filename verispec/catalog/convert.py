"""A GGUF made usable by transformers: its tokenizer (with the chat template) alone, or the whole model as bf16
safetensors. torch and transformers are imported inside the functions, so the catalog loads without them."""

from __future__ import annotations

from pathlib import Path

from verispec.catalog.disk import Progress, no_progress
from verispec.catalog.gguf import gguf_metadata


def extract_tokenizer(gguf: Path, out: Path) -> None:
    """GGUF -> its tokenizer (with the chat template) as a Hugging Face tokenizer directory. AutoTokenizer learns
    a GGUF's model type from a config it parses out of the whole header with gguf's reader (~10 s of Python over a
    151k-token vocabulary); where the architecture is a type it maps to a tokenizer by name, it is named instead,
    and only the tokenizer's fields are read."""
    from transformers import AutoTokenizer
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    kind = gguf_metadata(str(gguf)).get("general.architecture")
    named = {"tokenizer_type": kind} if TOKENIZER_MAPPING_NAMES.get(kind) else {}
    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, **named).save_pretrained(out)


def convert_gguf(gguf: Path, out: Path, progress: Progress = no_progress) -> None:
    """GGUF -> Hugging Face directory (bf16 safetensors + tokenizer with its chat template)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress("convert", 0, 3)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    progress("convert", 1, 3)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    progress("convert", 2, 3)
    if getattr(model, "hf_quantizer", None) is not None:  # weights are already plain tensors
        model.hf_quantizer.remove_quantization_config(model)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    progress("convert", 3, 3)
