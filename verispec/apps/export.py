"""Launch commands for distributed engines that serve the same speculative configuration.

When one machine is not enough (a 70B target, many users, several GPUs) the step up is an existing engine,
not a home-made one. `export(engine, spec)` turns a configuration (target, draft, drafter, k) into that
engine's launch command: pure functions from an `ExportSpec` (model locations already resolved for the
engine) to a `Launch` (argv tokens plus comment lines for what has no equivalent there).

Each flag was checked against the engine's own documentation or source:
- vLLM (main, commit 002e77c1: vllm/config/speculative.py; docs/features/speculative_decoding/draft_model.md at
  04329df5): `vllm serve MODEL --speculative-config JSON`, keys `method` ("draft_model", "ngram"), `model`,
  `num_speculative_tokens`, `prompt_lookup_max`, `prompt_lookup_min`, `draft_tensor_parallel_size`;
  `--tensor-parallel-size`, `--host`, `--port`.
- SGLang (main, commit fc6d4653: docs/advanced_features/speculative_decoding.md): `python3 -m
  sglang.launch_server --model-path`, `--speculative-algorithm STANDALONE|NGRAM`,
  `--speculative-draft-model-path`, `--speculative-num-steps`, `--speculative-eagle-topk`,
  `--speculative-num-draft-tokens` (with topk 1 it is num_steps + 1),
  `--speculative-ngram-{min,max}-match-window-size`, `--speculative-ngram-max-bfs-breadth`; `--tp-size`.
- llama.cpp's llama-server (master, commit 00dc8057: tools/server/README.md): `-m`, `-md` (`--model-draft`),
  `--spec-draft-n-max`, `--spec-draft-n-min`, `--draft-p-min`, `--spec-type draft-simple|ngram-simple`,
  `--spec-ngram-simple-size-n`, `--spec-ngram-simple-size-m`, `-ngl`, `-ngld`, `-sm row`, `--host`, `--port`.
  Builds before the spec-* rename (e.g. commit 25d5b0c5) spell the draft length `--draft-max`/`--draft-min`
  and have no n-gram drafting in the server; `-md`, `--draft-p-min`, `-ngl` and `-ngld` are in both.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass

from verispec.names.k import DEFAULT_K

ENGINES = ("vllm", "sglang", "llama-server")
DRAFTERS = ("model", "ngram", "hybrid")
AUTO_K = DEFAULT_K  # the fixed k used where cost-aware k has no equivalent
NGRAM_MAX, NGRAM_MIN = 4, 2  # verispec's prompt lookup: longest and shortest suffix it matches


@dataclass(frozen=True)
class ExportSpec:
    """A speculative configuration, model locations already resolved for the engine (an HF directory or hub
    id for vLLM/SGLang, a GGUF file for llama-server). `extra` is passed through verbatim."""

    target: str
    draft: str | None = None
    drafter: str = "model"
    k: int | str = AUTO_K
    draft_vocab: int = 0
    tensor_parallel_size: int = 1
    draft_tensor_parallel_size: int | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    gpu_layers: int | None = None
    extra: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.drafter not in DRAFTERS:
            raise ValueError(f"unknown drafter {self.drafter!r} (use {', '.join(DRAFTERS)})")
        if self.drafter != "ngram" and not self.draft:
            raise ValueError(f"the {self.drafter} drafter needs a draft model")
        if self.k != "auto" and not (isinstance(self.k, int) and self.k >= 1):
            raise ValueError(f"k must be an integer >= 1 or 'auto', got {self.k!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor parallel size must be >= 1, got {self.tensor_parallel_size}")
        if self.draft_tensor_parallel_size is not None and self.draft_tensor_parallel_size < 1:
            raise ValueError(f"draft tensor parallel size must be >= 1, got {self.draft_tensor_parallel_size}")
        if not 0 < self.port < 65536:
            raise ValueError(f"port must be in 1..65535, got {self.port}")

    @property
    def fixed_k(self) -> int:
        return AUTO_K if self.k == "auto" else int(self.k)


@dataclass(frozen=True)
class Launch:
    """An engine's launch command: argv tokens, and comment lines saying what did not carry over."""

    argv: tuple[str, ...]
    notes: tuple[str, ...] = ()
    head: int = 1  # leading tokens that name the program (kept on the first line)

    def render(self) -> str:
        """Comment lines, then the command (one flag per line, shell-quoted: ready to paste)."""
        lines = [f"# {n}" for n in self.notes]
        parts: list[list[str]] = [[]]
        for i, token in enumerate(self.argv):
            if token.startswith("-") and i >= self.head:
                parts.append([])
            parts[-1].append(shlex.quote(token))
        lines.append(" \\\n    ".join(" ".join(p) for p in parts))
        return "\n".join(lines)


def _common_notes(spec: ExportSpec, engine: str) -> list[str]:
    notes = []
    if spec.k == "auto":
        notes.append(f"cost-aware k (auto) has no {engine} equivalent: fixed k = {AUTO_K}")
    if spec.drafter == "hybrid":
        notes.append(f"hybrid drafting (n-gram when it matches confidently, else the draft model) has no {engine} "
                     "equivalent: the draft model alone")
    if spec.draft_vocab and spec.drafter != "ngram":
        notes.append(f"the reduced-vocabulary draft ({spec.draft_vocab} tokens) has no {engine} equivalent: "
                     "the draft scores its full vocabulary")
    return notes


def vllm(spec: ExportSpec) -> Launch:
    """`vllm serve` with `--speculative-config` (a draft model, or prompt lookup for the n-gram drafter)."""
    notes = _common_notes(spec, "vLLM")
    argv = ["vllm", "serve", spec.target, "--host", spec.host, "--port", str(spec.port)]
    if spec.tensor_parallel_size > 1:
        argv += ["--tensor-parallel-size", str(spec.tensor_parallel_size)]
    if spec.drafter == "ngram":
        config: dict = {"method": "ngram", "num_speculative_tokens": spec.fixed_k,
                        "prompt_lookup_max": NGRAM_MAX, "prompt_lookup_min": NGRAM_MIN}
    else:
        config = {"method": "draft_model", "model": spec.draft, "num_speculative_tokens": spec.fixed_k}
        if spec.draft_tensor_parallel_size is not None:
            config["draft_tensor_parallel_size"] = spec.draft_tensor_parallel_size
    argv += ["--speculative-config", json.dumps(config)]
    return Launch(tuple(argv + list(spec.extra)), tuple(notes), head=3)


def sglang(spec: ExportSpec) -> Launch:
    """SGLang's server with a standalone draft model (a chain: top-k 1), or its n-gram drafting."""
    notes = _common_notes(spec, "SGLang")
    argv = ["python3", "-m", "sglang.launch_server", "--model-path", spec.target, "--host", spec.host,
            "--port", str(spec.port)]
    if spec.tensor_parallel_size > 1:
        argv += ["--tp-size", str(spec.tensor_parallel_size)]
    k = spec.fixed_k
    if spec.drafter == "ngram":
        notes.append("SGLang's n-gram drafting runs on CUDA only; breadth 1 keeps one chain of drafts, as here")
        argv += ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", str(k + 1),
                 "--speculative-ngram-max-match-window-size", str(NGRAM_MAX),
                 "--speculative-ngram-min-match-window-size", str(NGRAM_MIN),
                 "--speculative-ngram-max-bfs-breadth", "1"]
    else:
        argv += ["--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", spec.draft,
                 "--speculative-num-steps", str(k), "--speculative-eagle-topk", "1",
                 "--speculative-num-draft-tokens", str(k + 1)]
    if spec.draft_tensor_parallel_size is not None:
        notes.append("SGLang runs the draft with the target's tensor parallelism: the draft size is not passed")
    return Launch(tuple(argv + list(spec.extra)), tuple(notes), head=3)


def llama_server(spec: ExportSpec) -> Launch:
    """llama.cpp's llama-server on GGUF files: a draft model with at most k drafts per round (drafting never
    stops early on low draft confidence: --draft-p-min 0), or its n-gram drafting."""
    notes = _common_notes(spec, "llama-server")
    argv = ["llama-server", "-m", spec.target, "--host", spec.host, "--port", str(spec.port)]
    if spec.gpu_layers is not None:
        argv += ["-ngl", str(spec.gpu_layers)]
    if spec.tensor_parallel_size > 1:
        notes.append(f"llama.cpp has no tensor parallel size: -sm row splits each layer across the visible GPUs "
                     f"(the {spec.tensor_parallel_size} GPUs asked for: set CUDA_VISIBLE_DEVICES); --rpc "
                     "HOST:PORT adds other machines")
        argv += ["-sm", "row"]
    k = spec.fixed_k
    if spec.drafter == "ngram":
        notes.append("needs a llama-server with --spec-type (the spec-* options)")
        argv += ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", str(NGRAM_MAX),
                 "--spec-ngram-simple-size-m", str(k)]
    else:
        notes.append(f"builds before the spec-* options: no --spec-type, and --draft-max {k} --draft-min 0 instead "
                     "of --spec-draft-n-max/--spec-draft-n-min")
        argv += ["-md", spec.draft, "--spec-type", "draft-simple", "--spec-draft-n-max", str(k),
                 "--spec-draft-n-min", "0", "--draft-p-min", "0"]
        if spec.gpu_layers is not None:
            argv += ["-ngld", str(spec.gpu_layers)]
    return Launch(tuple(argv + list(spec.extra)), tuple(notes))


EXPORTERS = {"vllm": vllm, "sglang": sglang, "llama-server": llama_server}


def export(engine: str, spec: ExportSpec) -> Launch:
    try:
        return EXPORTERS[engine](spec)
    except KeyError:
        raise ValueError(f"unknown engine {engine!r} (use {', '.join(ENGINES)})") from None


def locate(engine: str, ref: str) -> str:
    """Where an engine finds a model: llama-server a GGUF file, vLLM and SGLang a Hugging Face directory or
    hub id. Known names resolve to the cache (models/NAME/model.gguf, models/NAME/hf)."""
    from verispec.backends.loading import resolve, resolve_gguf
    from verispec.names.errors import ModelError

    if engine == "llama-server":
        return resolve_gguf(ref)
    source = resolve(ref)
    if source.gguf_file:
        raise ModelError(f"{engine} needs a Hugging Face directory or hub id, and '{ref}' is a GGUF file")
    return source.path
