"""The incremental text path against the one that decodes every id every round, with the shipped tokenizers
(Qwen2.5's byte-level BPE, SmolLM2's) on every prompt of HumanEval and Spec-Bench (../shared/bench-data) and a
Unicode set: the same stops, pieces, provenance and text, the text one decode of all the ids."""

from __future__ import annotations

import gzip
import json
import os
import random
from pathlib import Path

import pytest
from test_text import INVALID, UNICODE, assert_same_text, byte_ids, stops_of

from verispec.catalog import DEFAULT_TARGET

pytestmark = pytest.mark.integration

DATA = Path(os.environ.get("BENCH_DATA", Path(__file__).resolve().parents[3] / "shared" / "bench-data"))


def texts() -> list[str]:
    if not (DATA / "HumanEval.jsonl.gz").is_file():
        pytest.skip(f"no prompt sets at {DATA} (set BENCH_DATA)")
    with gzip.open(DATA / "HumanEval.jsonl.gz", "rt") as f:
        out = [r["prompt"] + r["canonical_solution"] for r in map(json.loads, f)]
    with open(DATA / "spec_bench_question.jsonl") as f:
        out += ["\n".join(r["turns"]) for r in map(json.loads, f)]
    return out + UNICODE


@pytest.mark.parametrize("name", [DEFAULT_TARGET, "smollm2-135m-instruct"])
def test_every_prompt_streams_as_the_reference_does(name):
    from verispec.backends.loading import load_tokenizer
    from verispec.catalog import installed

    if installed(name) is None:
        pytest.fail(f"{name} is not installed; run `make setup`")
    tok = load_tokenizer(name)
    rng = random.Random(0)
    prompts = texts()
    assert len(prompts) == 164 + 480 + len(UNICODE)
    for i, text in enumerate(prompts):
        ids = tok(text, add_special_tokens=False).input_ids
        stops = stops_of(text, rng)
        assert_same_text(tok, ids, stops[i % len(stops)], i)
    for i, data in enumerate(INVALID):  # raw bytes, valid UTF-8 or not (byte-level vocabularies hold every byte)
        assert_same_text(tok, byte_ids(tok, data), [], i)
