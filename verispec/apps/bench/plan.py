"""What one benchmark run compares, and the metadata its report carries.

`configurations` turns the lists a run is asked for (drafters × k values, draft variants, tree budgets, external
references) into the `Config`s the harness runs after the plain baseline; `metadata` and `endpoint_metadata`
describe a run in its report: when, the command, the models and machine, sampling, how it ended."""

from __future__ import annotations

import datetime
import platform
from typing import TYPE_CHECKING

from verispec.names.drafters import FREE_DRAFTERS
from verispec.names.options import SamplingParams

if TYPE_CHECKING:
    from verispec.apps.bench.harness import Config
    from verispec.pipeline.pipeline import Pipeline

REFERENCES = {  # an external reference's kind -> its name in the report, in the report's order
    "hf": "hf assisted",
    "hf-lookup": "hf prompt lookup",
    "llama": "llama.cpp plain",
    "llama-lookup": "llama.cpp prompt lookup",
}


def configurations(drafters: list[str], ks: list[int | str], variants: list[str], budgets: list[int | str],
                   compare: list[str]) -> list[Config]:
    """Each drafter at each k; a tree per node budget; each draft variant of each drafter with a draft model at
    each k; then the external references asked for (REFERENCES' kinds). Each is named by its drafter and k."""
    from verispec.apps.bench.harness import Config

    configs = [Config(f"{d} k={k}", "spec", k, d) for d in drafters for k in ks]
    configs += [Config(f"tree k={b}", "spec", b, "tree") for b in budgets]
    configs += [Config(f"{d}[{v}] k={k}", "spec", k, f"{d}[{v}]")
                for v in variants for d in drafters if d not in FREE_DRAFTERS for k in ks]
    configs += [Config(name, kind) for kind, name in REFERENCES.items() if kind in compare]
    return configs


def caveats(compare: list[str], params: SamplingParams, other_tokenizer: bool) -> list[str]:
    """What a reader must know before comparing the report's rows, one line each. transformers' sampled
    different-tokenizer assisted generation (UniversalSpeculativeDecodingGenerator) emits tokens the target gives
    almost no probability (docs/performance.md), so its tokens/s are not those of a lossless decoder."""
    if "hf" in compare and other_tokenizer and not params.greedy:
        return [f"{REFERENCES['hf']}: transformers' different-tokenizer sampling does not sample the target's "
                "distribution; its tokens/s are no lossless reference"]
    return []


def needs_draft_model(drafters: list[str], budgets: list[int | str], compare: list[str]) -> bool:
    """Whether a configuration runs a draft model: a model drafter, a tree, or HF assisted generation."""
    return any(d not in FREE_DRAFTERS for d in drafters) or "hf" in compare or bool(budgets)


def metadata(command: str, pipe: Pipeline, draft: str | None, params: SamplingParams, *, max_new_tokens: int,
             prompts_file: str | None, turn: int, warm_history: bool, repeats: int, draft_vocab: int,
             variants: list[str], rounds_only: bool, status: str, error: str | None = None) -> dict:
    """A local run's report metadata; `pipe` is the run's own pipeline (models, device, backends), `draft` the
    draft's label, `prompts_file` None for the built-in set, `status` complete, interrupted or failed (`error`
    says why)."""
    import torch

    return {
        **_stamp(command),
        "machine": {"cpu": platform.processor() or platform.machine(), "cores": torch.get_num_threads(),
                    "torch": torch.__version__, "device": str(pipe.device)},
        "target": pipe.target_ref, "draft": draft, "device": str(pipe.device), "dtype": pipe.dtype,
        "sampling": params.describe(),
        "max_new_tokens": max_new_tokens, "prompts_file": prompts_file or "built-in", "turn": turn,
        "warm_history": warm_history, "repeats": repeats,
        "draft_quant": pipe.draft_quant, "draft_vocab": draft_vocab,
        "draft_forward": pipe.draft_forward, "draft_variants": variants,
        "backend": pipe.backend, "draft_backend": pipe.draft_backend, "timed": "rounds" if rounds_only else "text",
        "status": status, **({"error": error} if error else {}),
    }


def endpoint_metadata(command: str, params: SamplingParams, *, max_new_tokens: int,
                      prompts_file: str | None, turn: int, status: str, concurrency: int) -> dict:
    """An endpoint run's report metadata; `concurrency` is the requests in flight (1: one after another)."""
    return {
        **_stamp(command),
        "sampling": params.describe(),
        "max_new_tokens": max_new_tokens, "prompts_file": prompts_file or "built-in", "turn": turn, "status": status,
        "concurrency": concurrency,
    }


def _stamp(command: str) -> dict:
    """When the run ended (UTC, to the second) and the command that started it."""
    return {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), "command": command}
