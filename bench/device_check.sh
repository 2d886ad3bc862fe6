#!/usr/bin/env bash
# The check to run wherever a CUDA device is lent (torch and transformers there, no network, no model files):
# exactness, host syncs per round, pass costs and plain against speculative rounds, on random models built in place
# (bench/device_check.py). Under 8 minutes on one GPU; its output comes back in $OUT/device_check.json when set.
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device here'"
timeout 480 python bench/device_check.py --device "${DEVICE:-cuda}" "$@" | tee "${OUT:-/tmp}/device_check.log"
tail -n 1 "${OUT:-/tmp}/device_check.log" > "${OUT:-/tmp}/device_check.json"
