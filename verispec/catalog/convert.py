"""A GGUF made usable by transformers: its tokenizer (with the chat template) alone, or the whole model as bf16
safetensors. torch and transformers are imported inside the functions, so the catalog loads without them."""

from __future__ import annotations

from pathlib import Path

from verispec.catalog.disk import Progress, no_progress


def extract_tokenizer(gguf: Path, out: Path) -> None:
    """GGUF -> its tokenizer (with the chat template) as a Hugging Face tokenizer directory."""
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name).save_pretrained(out)


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
