#!/usr/bin/env bash
# The default configuration of the default pair: bf16 transformers target, the 0.5B draft on
# transformers in int4 (--draft-quant auto), cost-aware k. In the same run: plain transformers decoding (the
# ratio base) and HF assisted generation (bf16 0.5B draft, library defaults). HumanEval, Spec-Bench, then
# HumanEval and Spec-Bench sampled at T=0.7 / top-p 0.9. PROMPTS / PER_CATEGORY / SAMPLED_PROMPTS /
# SAMPLED_PER_CATEGORY / MAX_NEW size the runs.
# Nothing else may run on the machine meanwhile: the k policy learns costs from wall-clock time.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
new="${MAX_NEW:-96}"
mkdir -p out
verispec bench --backend hf -k auto --compare hf --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-20}" \
    --max-new-tokens "$new" --json-out out/default_humaneval.json --plot-dir out/default_humaneval_plots
verispec bench --backend hf -k auto --prompts "$data/spec_bench_question.jsonl" --per-category "${PER_CATEGORY:-5}" \
    --max-new-tokens "$new" --json-out out/default_spec_bench.json --plot-dir out/default_spec_bench_plots
verispec bench --backend hf -k auto --temperature 0.7 --top-p 0.9 --seed 0 --compare hf \
    --prompts "$data/HumanEval.jsonl.gz" --limit "${SAMPLED_PROMPTS:-20}" --max-new-tokens "$new" \
    --json-out out/sampled_humaneval.json
verispec bench --backend hf -k auto --temperature 0.7 --top-p 0.9 --seed 0 --prompts "$data/spec_bench_question.jsonl" \
    --per-category "${SAMPLED_PER_CATEGORY:-5}" --max-new-tokens "$new" --json-out out/sampled_spec_bench.json
