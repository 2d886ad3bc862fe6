"""Prompt sets: Spec-Bench / MT-Bench question jsonl, HumanEval jsonl(.gz), plain text, the built-in set."""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

BUILTIN = Path(__file__).with_name("prompts.jsonl")
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SPEC_BENCH_ONLY = {"translation", "summarization", "qa", "math_reasoning", "rag"}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str
    chat: bool  # True: a user message for the chat template; False: raw completion (HumanEval)


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def load_prompts(path: str | Path | None = None, group_mt_bench: bool | None = None) -> list[Prompt]:
    """Reads a prompt file; Spec-Bench's eight MT-Bench categories are grouped as `mt_bench` (as its
    own evaluation does) when the file also has Spec-Bench's other categories."""
    path = Path(path) if path else BUILTIN
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path}")
    with _open_text(path) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        raise ValueError(f"prompt file is empty: {path}")
    prompts: list[Prompt] = []
    if not lines[0].lstrip().startswith("{"):
        return [Prompt(f"line-{i + 1}", "text", line.rstrip("\n"), True) for i, line in enumerate(lines)]
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({exc.msg})") from None
        if "turns" in rec:
            prompts.append(Prompt(str(rec.get("question_id", i)), str(rec.get("category", "default")), rec["turns"][0], True))
        elif "prompt" in rec:  # HumanEval: code completion, no chat template
            prompts.append(Prompt(str(rec.get("task_id", i)), "humaneval", rec["prompt"], False))
        else:
            raise ValueError(f"{path}:{i + 1}: expected a 'turns' (Spec-Bench/MT-Bench) or 'prompt' (HumanEval) field")
    categories = {p.category for p in prompts}
    if group_mt_bench is None:  # looks like Spec-Bench: most of both families of categories present
        group_mt_bench = len(categories & SPEC_BENCH_ONLY) >= 3 and len(categories & MT_BENCH_CATEGORIES) >= 3
    if group_mt_bench:
        prompts = [Prompt(p.id, "mt_bench" if p.category in MT_BENCH_CATEGORIES else p.category, p.text, p.chat)
                   for p in prompts]
    return prompts


def select(prompts: list[Prompt], limit: int | None = None, per_category: int | None = None) -> list[Prompt]:
    """The first `per_category` of each category (in file order), then the first `limit` overall."""
    if per_category is not None:
        by_cat: OrderedDict[str, list[Prompt]] = OrderedDict()
        for p in prompts:
            by_cat.setdefault(p.category, []).append(p)
        prompts = [p for group in by_cat.values() for p in group[:per_category]]
    if limit is not None:
        prompts = prompts[:limit]
    return prompts
