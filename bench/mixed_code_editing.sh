#!/usr/bin/env bash
# Mixed backends on the built-in code-editing and summarisation prompts: bf16 transformers target, 0.5B draft
# on llama.cpp, each drafter with cost-aware k; llama-cpp-python's plain decoding of the 1.5B GGUF beside it.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out
verispec bench --backend hf --draft-backend llamacpp -k auto --drafters model,ngram,hybrid --compare llama \
    --categories code-editing,summarization --max-new-tokens "${MAX_NEW:-96}" \
    --json-out out/mixed_code_editing.json --plot-dir out/mixed_code_editing_plots
