#!/usr/bin/env bash
# The llama.cpp backend (issue 8): one `verispec bench` run per prompt set, each with its baselines in the
# same process. Target and draft on llama.cpp; references: verispec's own plain decoding on llama.cpp (the
# ratio base), llama-cpp-python's plain decoding and its prompt lookup decoding; verispec with each drafter
# and cost-aware k. Needs `make install-llamacpp`. PROMPTS / PER_CATEGORY / MAX_NEW size the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
mkdir -p out
run() {  # name, then bench arguments
    local name="$1"; shift
    verispec bench --backend llamacpp -k auto --drafters model,ngram,hybrid --compare llama --compare llama-lookup \
        --max-new-tokens "${MAX_NEW:-96}" --json-out "out/$name.json" --plot-dir "out/${name}_plots" "$@"
}
run llama_humaneval --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-6}"
run llama_code_editing --categories code-editing,summarization
run llama_spec_bench --prompts "$data/spec_bench_question.jsonl" --per-category "${PER_CATEGORY:-1}"
