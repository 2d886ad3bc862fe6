#!/usr/bin/env bash
# Token trees against chains on the default pair (transformers backend): plain decoding (the ratio base), the
# draft model's chain at k = 4 (K: e.g. 4,auto), and the tree drafter at an auto budget, in one run per prompt set:
# HumanEval 20 and Spec-Bench 5 per category, greedy, then both sampled at T=0.7 / top-p 0.9 (SAMPLED_PROMPTS,
# SAMPLED_PER_CATEGORY). DTYPE (default fp32: on CPUs without native bf16 it is the faster dtype), MAX_NEW,
# PROMPTS, PER_CATEGORY size the runs. bench/tree_costs.py gives the verify cost per node count beside it.
# Nothing else may run on the machine meanwhile: both k policies learn costs from wall-clock time.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
new="${MAX_NEW:-96}"
dtype="${DTYPE:-fp32}"
mkdir -p out
run() { verispec bench --backend hf --dtype "$dtype" -k "${K:-4}" --tree --tree-budget auto --max-new-tokens "$new" "$@"; }
run --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-20}" --json-out out/trees_humaneval.json
run --prompts "$data/spec_bench_question.jsonl" --per-category "${PER_CATEGORY:-5}" --json-out out/trees_spec_bench.json
run --temperature 0.7 --top-p 0.9 --seed 0 --prompts "$data/HumanEval.jsonl.gz" --limit "${SAMPLED_PROMPTS:-20}" \
    --json-out out/trees_sampled_humaneval.json
run --temperature 0.7 --top-p 0.9 --seed 0 --prompts "$data/spec_bench_question.jsonl" \
    --per-category "${SAMPLED_PER_CATEGORY:-5}" --json-out out/trees_sampled_spec_bench.json
