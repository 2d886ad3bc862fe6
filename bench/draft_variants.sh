#!/usr/bin/env bash
# Draft setups side by side in one run (which draft should be the default): the default int4 transformers
# draft, the same with a reduced 32k-token head (--draft-vocab 32768), and the draft's GGUF on llama.cpp
# (needs the [llamacpp] extra); on HumanEval, then on the long-prompt Spec-Bench categories with the hybrid
# drafter too. PROMPTS / PER_CATEGORY / MAX_NEW size the runs.
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
mkdir -p out
verispec bench --backend hf -k auto --draft-variants hf-int4-v32768,llamacpp --prompts "$data/HumanEval.jsonl.gz" \
    --limit "${PROMPTS:-6}" --max-new-tokens "${MAX_NEW:-96}" --json-out out/variants_humaneval.json
verispec bench --backend hf -k auto --drafters model,hybrid --draft-variants llamacpp \
    --prompts "$data/spec_bench_question.jsonl" --categories rag,summarization,qa --per-category "${PER_CATEGORY:-2}" \
    --max-new-tokens "${MAX_NEW:-96}" --json-out out/variants_spec_bench.json
