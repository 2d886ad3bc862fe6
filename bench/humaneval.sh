#!/usr/bin/env bash
# HumanEval completions (20 problems): draft model, n-gram and hybrid drafters vs plain decoding.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
mkdir -p out
exec verispec bench --backend hf --prompts "$data/HumanEval.jsonl.gz" --limit 20 --drafters model,ngram,hybrid \
    --compare hf --json-out out/humaneval.json --plot-dir out/humaneval_plots "$@"
