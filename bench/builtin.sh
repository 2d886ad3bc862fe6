#!/usr/bin/env bash
# built-in prompt set, every drafter at k=4, int8 draft, 96 new tokens.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out
exec verispec bench --backend hf --drafters model,ngram,hybrid -k 4 --draft-quant int8 --max-new-tokens 96 \
    --json-out out/builtin.json --plot-dir out/builtin_plots "$@"
