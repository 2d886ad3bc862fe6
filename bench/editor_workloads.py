"""Editor workloads cut from HumanEval (../shared/bench-data, MIT): fill-in-the-middle requests and whole-function
edits, as prompt files `verispec bench` reads (`--prompts`) and bench/fim_session.py types.

    python bench/editor_workloads.py [--out out/editor] [--problems 20] [--edits 9]

Writes, for the first --problems problems with a solution of at least three lines (each the problem's prompt and
canonical solution, one file of code):
- fim_line.jsonl: one line of the solution cut out (the middle line of its non-blank ones): prefix = the code
  before it, suffix = a newline and the code after it; `expected` the line.
- fim_multi.jsonl: two to four lines cut out from the same place (as many as the solution has after it).
and for the first --edits problems:
- edits.jsonl: chat prompts asking for the whole function back, edited: renamed, commented, or reindented to two
  spaces (in turn): the answer copies its context, as an editor's "apply edit" does.
Every record names its problem (question_id) and kind (category)."""

from __future__ import annotations

import argparse
import gzip
import json
import os
from pathlib import Path

DATA = Path(os.environ.get("BENCH_DATA", Path(__file__).resolve().parents[2] / "shared" / "bench-data"))

EDITS = (
    ("rename", "Rename the function `{name}` to `{name}_v2` everywhere in this code (its recursive calls and "
               "doctests too) and return the whole code, nothing else:\n\n{code}"),
    ("comment", "Add a short comment above every statement of the function body of this code, change nothing "
                "else, and return the whole code, nothing else:\n\n{code}"),
    ("reindent", "Reindent this code to use two spaces per indentation level instead of four, change nothing "
                 "else, and return the whole code, nothing else:\n\n{code}"),
)


def problems() -> list[dict]:
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def cut(problem: dict, lines: int) -> dict | None:
    """The problem's code with `lines` solution lines (from the middle non-blank one on) cut out, as an infill
    record; None when the solution is too short."""
    code = (problem["prompt"] + problem["canonical_solution"]).rstrip("\n") + "\n"
    rows = code.split("\n")
    start = len(problem["prompt"].split("\n")) - 1  # the solution's first row
    body = [i for i in range(start, len(rows)) if rows[i].strip()]
    if len(body) < 3:
        return None
    first = body[len(body) // 2]
    last = min(first + lines, len(rows) - 1)
    if last <= first:
        return None
    return {"prefix": "\n".join(rows[:first]) + "\n", "suffix": "\n" + "\n".join(rows[last:]),
            "expected": "\n".join(rows[first:last])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="out/editor", help="folder for the jsonl files")
    ap.add_argument("--problems", type=int, default=20, help="infills: this many problems")
    ap.add_argument("--edits", type=int, default=9, help="edits: this many problems")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    every = problems()
    sets: dict[str, list[dict]] = {"fim_line": [], "fim_multi": [], "edits": []}
    for p in every:
        if len(sets["fim_line"]) >= args.problems:
            break
        single = cut(p, 1)
        multi = cut(p, 2 + len(sets["fim_multi"]) % 3)
        if single is None or multi is None:
            continue
        sets["fim_line"].append({"question_id": p["task_id"], "category": "fim-line", **single})
        sets["fim_multi"].append({"question_id": p["task_id"], "category": "fim-multi", **multi})
    for i, p in enumerate(every[: args.edits]):
        kind, template = EDITS[i % len(EDITS)]
        code = (p["prompt"] + p["canonical_solution"]).rstrip("\n")
        sets["edits"].append({"question_id": p["task_id"], "category": f"edit-{kind}",
                              "turns": [template.format(name=p["entry_point"], code=code)]})
    for name, records in sets.items():
        with open(out / f"{name}.jsonl", "w", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in records)
        print(f"{out / (name + '.jsonl')}: {len(records)} records")


if __name__ == "__main__":
    main()
