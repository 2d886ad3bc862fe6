#!/usr/bin/env bash
# The llama.cpp backend (issue 8), one `verispec bench` run per prompt set, each with its baseline in the
# same process. Needs `make install-llamacpp`.
#   all-llama: target and draft on llama.cpp; plain llama-cpp-python decoding and its prompt lookup as
#              references; verispec with each drafter and cost-aware k.
#   mixed:     a transformers (bf16) target with a llama.cpp draft; llama.cpp plain decoding as reference.
# PROMPTS=N limits HumanEval, PER_CATEGORY=N Spec-Bench; MAX_NEW (default 96).
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
max_new="${MAX_NEW:-96}"
mkdir -p out
run() {  # name, then bench arguments
    local name="$1"; shift
    verispec bench --max-new-tokens "$max_new" --json-out "out/$name.json" --plot-dir "out/${name}_plots" "$@"
}
llama=(--backend llamacpp -k auto --drafters model,ngram,hybrid --compare llama --compare llama-lookup)
run llama_humaneval "${llama[@]}" --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-10}"
run llama_code_editing "${llama[@]}" --categories code-editing,summarization
run llama_spec_bench "${llama[@]}" --prompts "$data/spec_bench_question.jsonl" --per-category "${PER_CATEGORY:-2}"
run mixed_humaneval --draft-backend llamacpp -k auto --drafters model,hybrid --compare llama \
    --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-10}"
