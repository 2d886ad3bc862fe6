#!/usr/bin/env bash
# A draft of another tokenizer: SmolLM2-135M (49,152 tokens) drafting for Qwen2.5-Coder-1.5B (151,936), against
# the same-family Qwen2.5-Coder-0.5B draft, greedy and at temperature 0.7, on llama.cpp and transformers; on
# transformers also against Hugging Face's own different-tokenizer assisted generation (--compare hf: its
# AssistedCandidateGeneratorDifferentTokenizers when greedy, UniversalSpeculativeDecodingGenerator when sampling).
# Every `verispec bench` run times plain decoding in the same process and prints ratios. Sizes (environment):
#   LIMIT (HumanEval problems, 20), SPEC_PER_CATEGORY (Spec-Bench questions per category, 0: skip; the full goal
#   is 30 questions), MAX_NEW (128), HF_LIMIT (transformers problems, 4), HF_MAX_NEW (48), BACKENDS (llamacpp hf),
#   MODES (greedy t07), DRAFTS (smollm2-135m-instruct qwen2.5-coder-0.5b-instruct).
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
LIMIT="${LIMIT:-20}" SPEC_PER_CATEGORY="${SPEC_PER_CATEGORY:-0}" MAX_NEW="${MAX_NEW:-128}"
HF_LIMIT="${HF_LIMIT:-4}" HF_MAX_NEW="${HF_MAX_NEW:-48}" BACKENDS="${BACKENDS:-llamacpp hf}"
MODES="${MODES:-greedy t07}" DRAFTS="${DRAFTS:-smollm2-135m-instruct qwen2.5-coder-0.5b-instruct}"
declare -A SAMPLING=([greedy]="" [t07]="--temperature 0.7 --seed 1")
mkdir -p out/cross_vocab
sets=("humaneval:--prompts $data/HumanEval.jsonl.gz")
if [ "$SPEC_PER_CATEGORY" -gt 0 ]; then
  sets+=("specbench:--prompts $data/spec_bench_question.jsonl --per-category $SPEC_PER_CATEGORY")
fi
for backend in $BACKENDS; do
  for entry in "${sets[@]}"; do
    name="${entry%%:*}" prompts="${entry#*:}"
    for mode in $MODES; do
      flags="${SAMPLING[$mode]}"
      for draft in $DRAFTS; do
        if [ "$backend" = hf ]; then
          size=(--limit "$HF_LIMIT" --max-new-tokens "$HF_MAX_NEW" --dtype fp32)
          compare=(--compare hf)
        else
          size=(--limit "$LIMIT" --max-new-tokens "$MAX_NEW")
          compare=()
        fi
        [ "$name" = specbench ] && size=("${size[@]:2}")  # Spec-Bench: per category, not a limit
        echo "== $backend $name $mode draft=$draft" >&2
        # shellcheck disable=SC2086
        verispec bench --backend "$backend" --draft "$draft" --draft-backend "$backend" --drafters model -k 4 \
          $prompts "${size[@]}" $flags "${compare[@]}" \
          --json-out "out/cross_vocab/${backend}_${name}_${mode}_${draft}.json" "$@"
      done
    done
  done
done
