"""Resolve a model reference (known name, HF directory, GGUF file, hub id) and load it on a device."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from verispec.catalog import KNOWN_MODELS, installed, transformers_dir
from verispec.names.errors import ModelError

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ModelError(f"device '{device}' was asked for, but no CUDA device is available")
    if device != "cpu" and not device.startswith("cuda"):
        raise ModelError(f"unknown device '{device}' (use auto, cpu or cuda)")
    return torch.device(device)


@dataclass(frozen=True)
class ModelSource:
    """Where a model comes from: a directory (with an optional GGUF file inside it) or a hub id."""

    path: str
    gguf_file: str | None = None
    label: str = ""


def resolve(ref: str, weights: bool = True) -> ModelSource:
    """Where transformers finds a model; `weights` False: the tokenizer only, which a known model has without its
    conversion for transformers."""
    if ref in KNOWN_MODELS:
        return ModelSource(str(transformers_dir(ref, weights)), None, ref)
    p = Path(ref).expanduser()
    if p.is_file():
        if p.suffix != ".gguf":
            raise ModelError(f"'{ref}' is a file but not a .gguf file")
        return ModelSource(str(p.parent), p.name, ref)
    if p.is_dir():
        if (p / "config.json").is_file():
            return ModelSource(str(p), None, ref)
        if (p / "hf" / "config.json").is_file():  # a verispec cache entry
            return ModelSource(str(p / "hf"), None, ref)
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return ModelSource(str(p), ggufs[0].name, ref)
        raise ModelError(f"'{ref}' is a directory without config.json or a single .gguf file")
    looks_like_path = ref.startswith((".", "/", "~")) or ref.endswith(".gguf") or ref.count("/") > 1
    if looks_like_path or "/" not in ref:
        raise ModelError(
            f"model '{ref}' not found: not a known name ({', '.join(KNOWN_MODELS)}), a local directory or a GGUF file"
        )
    return ModelSource(ref, None, ref)  # a hub id


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")


def _source_kwargs(ref: str, weights: bool) -> tuple[ModelSource, dict, bool]:
    src = resolve(ref, weights)
    kwargs: dict = {"gguf_file": src.gguf_file} if src.gguf_file else {}
    is_hub = not Path(src.path).exists()
    if is_hub:
        kwargs["local_files_only"] = _offline()
    return src, kwargs, is_hub


def _load(ref: str, loader, weights: bool = True, **extra):
    src, kwargs, is_hub = _source_kwargs(ref, weights)
    try:
        return loader(src.path, **kwargs, **extra)
    except (OSError, ValueError) as exc:
        if is_hub:
            raise ModelError(
                f"cannot load '{ref}' from the model hub ({'offline' if _offline() else 'unreachable'}): use a known "
                f"name (`verispec models pull`), a local Hugging Face directory or a .gguf file"
            ) from exc
        raise ModelError(f"cannot load '{ref}': {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}") from exc


def load_tokenizer(ref: str):
    from transformers import AutoTokenizer

    return _load(ref, AutoTokenizer.from_pretrained, weights=False)


def load_model(ref: str, device: torch.device, dtype: torch.dtype):
    """The model in eval mode on `device`."""
    from transformers import AutoModelForCausalLM

    return _load(ref, AutoModelForCausalLM.from_pretrained, dtype=dtype).to(device).eval()


def eos_token_ids(model, tokenizer) -> list[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return sorted(ids)


# llama.cpp's end-of-generation rule (llama-vocab.cpp, where it loads a vocabulary): a token ends generation
# when its text is one of EOG_TEXTS, when it is the vocabulary's FIM pad, FIM repo or FIM file-separator
# token (the vocabulary's token with a text of the group in FIM_EOG_TEXTS; llama.cpp takes whichever it meets
# first, this the first in the list), or when it is the EOS token. Where a vocabulary has every token of a
# set in EOG_EXCLUSIONS, the set's last token is dropped (gpt-oss' and Solar's <|end|>, Gemma 4's </s>).
EOG_TEXTS = frozenset({
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<|return|>", "<|call|>", "<|flush|>", "<|calls|>", "<end_of_turn>",
    "<|endoftext|>", "</s>", "<|eom_id|>", "<EOT>", "_<EOT>", "[EOT]", "[EOS]", "<|end_of_text|>",
    "<end_of_utterance>", "<eos>", "<turn|>", "<|tool_response>",
})
FIM_EOG_TEXTS = (
    ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"),
    ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"),
    ("<|file_sep|>",),
)
EOG_EXCLUSIONS = (("<|return|>", "<|call|>", "<|end|>"), ("<|calls|>", "<|flush|>", "<|end|>"),
                  ("<|tool_response>", "</s>"))


def eog_ids_of_vocab(vocab: Mapping[str, int], eos_ids: list[int]) -> list[int]:
    """The ids llama.cpp ends generation at, by its rule (see EOG_TEXTS) over a vocabulary (token text ->
    id) whose EOS ids are `eos_ids`."""
    ids = {vocab[text] for text in EOG_TEXTS if text in vocab}
    ids.update(next(vocab[text] for text in group if text in vocab) for group in FIM_EOG_TEXTS
               if any(text in vocab for text in group))
    for texts in EOG_EXCLUSIONS:
        if all(text in vocab and vocab[text] in ids for text in texts):
            ids.discard(vocab[texts[-1]])
    return sorted(ids | set(eos_ids))


def eog_token_ids(tokenizer) -> list[int]:
    """The ids that end generation for a model with this tokenizer, on every backend alike: its EOS id and
    the tokens llama.cpp treats as the end of generation (e.g. Qwen's <|endoftext|> and FIM tokens besides
    <|im_end|>). llama.cpp stops at all of them; with only the configured EOS, generation would run on where
    llama.cpp's own decoding stops, and a transformers model would disagree with its own GGUF on length."""
    return eog_ids_of_vocab(tokenizer.get_vocab(), eos_token_ids(None, tokenizer))


def resolve_gguf(ref: str) -> str:
    """The GGUF file behind a reference, for the llama.cpp backend: a known name (its cached model.gguf), a
    .gguf file, or a directory holding exactly one."""
    if ref in KNOWN_MODELS:
        path = installed(ref)
        if path is None:
            raise ModelError(f"model '{ref}' is not installed; run `verispec models pull {ref}`")
        return str(path / "model.gguf")
    p = Path(ref).expanduser()
    if p.is_file() and p.suffix == ".gguf":
        return str(p)
    if p.is_dir():
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return str(ggufs[0])
    raise ModelError(f"the llama.cpp backend needs a GGUF model: '{ref}' is not a known name, a .gguf file or a "
                     f"directory with one .gguf file")


def configured_eos_ids(ref: str) -> list[int]:
    """EOS ids from the generation_config.json beside a model (e.g. Qwen's <|im_end|> and <|endoftext|>)."""
    from transformers import GenerationConfig

    src = resolve(ref, weights=False)
    if not (Path(src.path) / "generation_config.json").is_file():
        return []
    value = GenerationConfig.from_pretrained(src.path).eos_token_id
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


__all__ = [
    "ModelSource", "configured_eos_ids", "eog_ids_of_vocab", "eog_token_ids", "eos_token_ids",
    "load_model", "load_tokenizer", "resolve", "resolve_gguf",
]
