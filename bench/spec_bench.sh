#!/usr/bin/env bash
# Spec-Bench (5 per category), default pair, verispec k=4 vs HF assisted.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
mkdir -p out
exec verispec bench --backend hf --prompts "$data/spec_bench_question.jsonl" --per-category 5 --compare hf \
    --json-out out/spec_bench.json --plot-dir out/spec_bench_plots "$@"
