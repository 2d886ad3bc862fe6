#!/usr/bin/env bash
# The llama.cpp backend: one `verispec bench` run per prompt set, each with its baselines in the
# same process. Target and draft on llama.cpp; references: verispec's own plain decoding on llama.cpp (the
# ratio base), llama-cpp-python's plain decoding and its prompt lookup decoding; verispec with each drafter
# and cost-aware k. Then the mixed setup (llama.cpp draft, bf16 transformers target) against the same
# references. Every prompt runs REPEATS times per configuration (interleaved, pooled): single runs on this
# noisy machine swing +-10-15%. Needs `make install-llamacpp`. PROMPTS / PER_CATEGORY / MAX_NEW / REPEATS
# size the runs; SETS picks some of: humaneval code_editing spec_bench mixed.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
mkdir -p out
run() {  # name, then bench arguments
    local name="$1"; shift
    verispec bench -k auto --compare llama --max-new-tokens "${MAX_NEW:-96}" --repeats "${REPEATS:-3}" \
        --json-out "out/$name.json" --plot-dir "out/${name}_plots" "$@"
}
all_llama=(--backend llamacpp --drafters model,ngram,hybrid --compare llama-lookup)
for set in ${SETS:-humaneval code_editing spec_bench mixed}; do
    case "$set" in
        humaneval) run llama_humaneval "${all_llama[@]}" --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-6}" ;;
        code_editing) run llama_code_editing "${all_llama[@]}" --categories code-editing,summarization ;;
        spec_bench) run llama_spec_bench "${all_llama[@]}" --prompts "$data/spec_bench_question.jsonl" \
            --per-category "${PER_CATEGORY:-1}" ;;
        mixed) run llama_mixed_humaneval --backend hf --draft-backend llamacpp --drafters model,hybrid \
            --prompts "$data/HumanEval.jsonl.gz" --limit "${PROMPTS:-6}" ;;
        *) echo "unknown set '$set'" >&2; exit 2 ;;
    esac
done
