#!/usr/bin/env bash
# The built-in prompt set: every drafter at k = 2, 4, 6, plus HF assisted generation and prompt lookup.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p out
exec verispec bench --backend hf --drafters model,ngram,hybrid -k 2,4,6 --compare hf --compare hf-lookup \
    --json-out out/drafters.json --plot-dir out/drafters_plots "$@"
