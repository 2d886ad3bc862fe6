"""Prompt sets: Spec-Bench / MT-Bench question jsonl, HumanEval jsonl(.gz), fill-in-the-middle jsonl ({"prefix",
"suffix"} records, optionally "files": [{"filename", "text"}] and the "expected" middle), plain text, the built-in
set.

A later turn of a multi-turn question (MT-Bench's second turns) is a Prompt with `history`, the earlier user
turns; the answers to them are not in the files: `answer_history` fills them in from a model (the bench uses
the target's plain greedy decoding, untimed), so that every configuration is timed on the same conversation."""

from __future__ import annotations

import gzip
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

BUILTIN = Path(__file__).with_name("prompts.jsonl")
MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SPEC_BENCH_ONLY = {"translation", "summarization", "qa", "math_reasoning", "rag"}


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    text: str  # a chat turn, a raw completion's text, or a fill-in-the-middle prompt's prefix
    chat: bool  # True: a user message for the chat template; False: raw completion (HumanEval) or infill
    history: tuple[str, ...] = ()  # earlier user turns of the conversation, oldest first
    answers: tuple[str, ...] = ()  # the assistant's answers to them, once known (see answer_history)
    suffix: str | None = None  # fill in the middle between text and suffix (None: not an infill)
    files: tuple[tuple[str, str], ...] = ()  # an infill's other files: (name, text)
    expected: str | None = None  # an infill's true middle, where known

    @property
    def infill(self) -> bool:
        return self.suffix is not None

    def messages(self) -> list[dict]:
        """The conversation up to this turn as chat messages: each earlier turn with its answer, then this one."""
        if len(self.answers) != len(self.history):
            raise ValueError(f"prompt {self.id}: its {len(self.history)} earlier turns have "
                             f"{len(self.answers)} answers (see answer_history)")
        messages = []
        for user, assistant in zip(self.history, self.answers):
            messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
        return messages + [{"role": "user", "content": self.text}]


def answer_history(prompts: list[Prompt], answer: Callable[[Prompt], str]) -> list[Prompt]:
    """Prompts whose earlier turns are answered: `answer(prompt)` gives the assistant's reply to a prompt's
    conversation (see Prompt.messages); it is asked once per earlier turn, in order."""
    out = []
    for p in prompts:
        answers: list[str] = []
        for i, user in enumerate(p.history):
            answers.append(answer(replace(p, text=user, history=p.history[:i], answers=tuple(answers))))
        out.append(replace(p, answers=tuple(answers)))
    return out


def _open_text(path: Path):
    return gzip.open(path, "rt", encoding="utf-8") if path.suffix == ".gz" else open(path, encoding="utf-8")


def load_prompts(path: str | Path | None = None, group_mt_bench: bool | None = None, turn: int = 1) -> list[Prompt]:
    """Reads a prompt file; Spec-Bench's eight MT-Bench categories are grouped as `mt_bench` (as its
    own evaluation does) when the file also has Spec-Bench's other categories. `turn` > 1: the `turn`-th user
    turn of each multi-turn question, with the earlier ones as its history; questions with fewer turns are
    left out."""
    if turn < 1:
        raise ValueError(f"turn must be >= 1, got {turn}")
    path = Path(path) if path else BUILTIN
    if not path.is_file():
        raise ValueError(f"prompt file not found: {path}")
    with _open_text(path) as f:
        lines = [line for line in f if line.strip()]
    if not lines:
        raise ValueError(f"prompt file is empty: {path}")
    prompts: list[Prompt] = []
    if not lines[0].lstrip().startswith("{"):
        if turn > 1:
            raise ValueError(f"{path}: plain text prompts have one turn each; turn {turn} needs multi-turn "
                             f"questions (a 'turns' field, as in MT-Bench)")
        return [Prompt(f"line-{i + 1}", "text", line.rstrip("\n"), True) for i, line in enumerate(lines)]
    for i, line in enumerate(lines):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{i + 1}: not valid JSON ({exc.msg})") from None
        if "turns" in rec:
            turns = rec["turns"]
            if not isinstance(turns, list) or not turns or not all(isinstance(t, str) for t in turns):
                raise ValueError(f"{path}:{i + 1}: 'turns' must be a non-empty list of strings")
            if len(turns) >= turn:
                prompts.append(Prompt(str(rec.get("question_id", i)), str(rec.get("category", "default")),
                                      turns[turn - 1], True, tuple(turns[:turn - 1])))
        elif "prefix" in rec and "suffix" in rec:  # fill in the middle
            if turn > 1:
                raise ValueError(f"{path}:{i + 1}: an infill has one turn; turn {turn} needs multi-turn questions")
            files = tuple((f.get("filename", "tmp"), f["text"]) for f in rec.get("files", ()))
            prompts.append(Prompt(str(rec.get("question_id", i)), str(rec.get("category", "fim")), rec["prefix"],
                                  False, suffix=rec["suffix"], files=files, expected=rec.get("expected")))
        elif "prompt" in rec:  # HumanEval: code completion, no chat template
            if turn > 1:
                raise ValueError(f"{path}:{i + 1}: a HumanEval prompt has one turn; turn {turn} needs multi-turn "
                                 f"questions (a 'turns' field, as in MT-Bench)")
            prompts.append(Prompt(str(rec.get("task_id", i)), "humaneval", rec["prompt"], False))
        else:
            raise ValueError(f"{path}:{i + 1}: expected a 'turns' (Spec-Bench/MT-Bench), 'prompt' (HumanEval) or "
                             f"'prefix' and 'suffix' (fill in the middle) field")
    if not prompts:
        raise ValueError(f"{path}: no question has {turn} turns")
    categories = {p.category for p in prompts}
    if group_mt_bench is None:  # looks like Spec-Bench: most of both families of categories present
        group_mt_bench = len(categories & SPEC_BENCH_ONLY) >= 3 and len(categories & MT_BENCH_CATEGORIES) >= 3
    if group_mt_bench:
        prompts = [replace(p, category="mt_bench") if p.category in MT_BENCH_CATEGORIES else p for p in prompts]
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
