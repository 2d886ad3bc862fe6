#!/usr/bin/env bash
# The default configuration of the default pair (issue 6): bf16 transformers target, the 0.5B draft on
# llama.cpp (--draft-backend auto picks it when llama-cpp-python is installed), cost-aware k. References in
# the same run: plain transformers decoding (the ratio base), HF assisted generation (bf16 0.5B draft) and
# llama-cpp-python's plain decoding of the 1.5B GGUF. PROMPTS / PER_CATEGORY / MAX_NEW size the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
mkdir -p out
verispec bench -k auto --compare hf --compare llama --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-20}" \
    --max-new-tokens "${MAX_NEW:-96}" --json-out out/default_humaneval.json --plot-dir out/default_humaneval_plots
verispec bench -k auto --prompts "$data/spec_bench_question.jsonl" --per-category "${PER_CATEGORY:-3}" \
    --max-new-tokens "${MAX_NEW:-96}" --json-out out/default_spec_bench.json --plot-dir out/default_spec_bench_plots
