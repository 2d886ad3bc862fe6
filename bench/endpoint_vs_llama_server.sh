#!/usr/bin/env bash
# Servers against servers, one `verispec bench --endpoint` run: llama-cpp-python's own OpenAI server
# (python -m llama_cpp.server) on the model's GGUF, plain (the baseline) and with its prompt lookup drafts,
# against `verispec serve` on the same GGUF (llama.cpp backend), every prompt on every server, interleaved
# prompt by prompt. All three listen on 127.0.0.1 and are stopped on exit. Prints the table and the JSON line.
#   MODEL      smollm2-135m-instruct (default; verispec drafts with prompt lookup, no draft model) or
#              qwen2.5-coder-1.5b-instruct (the default pair: the 0.5B GGUF drafts, k = auto)
#   SET        mt_bench (default) | humaneval | spec_bench: prompt set from ../shared/bench-data (BENCH_DATA)
#   PROMPTS    prompts from the set (default 10); MAX_NEW new tokens per prompt (default 128)
#   NCTX       context per llama-cpp-python server (default 8192, as verispec's llama.cpp backend)
# Every llama.cpp uses all cores for decode and batch and flash attention, as verispec's llama.cpp backend does.
# Extra arguments go to `verispec bench` (e.g. --temperature 0.7 --seed 1).
set -euo pipefail
cd "$(dirname "$0")/.."
data="${BENCH_DATA:-../shared/bench-data}"
model="${MODEL:-smollm2-135m-instruct}"
threads="$(nproc)"
nctx="${NCTX:-8192}"
python="${PYTHON:-python}"
case "${SET:-mt_bench}" in
    mt_bench) prompts=(--prompts "$data/mt_bench_question.jsonl") ;;
    humaneval) prompts=(--prompts "$data/HumanEval.jsonl.gz") ;;
    spec_bench) prompts=(--prompts "$data/spec_bench_question.jsonl") ;;
    *) echo "unknown SET '$SET' (mt_bench, humaneval, spec_bench)" >&2; exit 2 ;;
esac
case "$model" in
    smollm2-135m-instruct) spec=(--target "$model" --drafter ngram) ;;
    qwen2.5-coder-1.5b-instruct) spec=(--drafter model) ;;  # the default pair
    *) echo "unknown MODEL '$model' (smollm2-135m-instruct, qwen2.5-coder-1.5b-instruct)" >&2; exit 2 ;;
esac
gguf="$("$python" -c "import sys; from verispec.backends.loading import resolve_gguf; print(resolve_gguf(sys.argv[1]))" "$model")"

mkdir -p out
logs="out/endpoint_servers"
mkdir -p "$logs"
pids=()
stop() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap stop EXIT
free_port() { "$python" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }
wait_up() {  # url, pid
    for _ in $(seq 600); do
        kill -0 "$2" 2>/dev/null || { echo "a server exited while starting; see $logs/" >&2; exit 1; }
        "$python" -c "import httpx, sys; sys.exit(httpx.get(sys.argv[1], timeout=1).status_code != 200)" "$1" \
            2>/dev/null && return 0
        sleep 0.5
    done
    echo "server at $1 did not start; see $logs/" >&2; exit 1
}
llama_server() {  # name, then llama_cpp.server settings
    local name="$1" port; shift
    port="$(free_port)"
    "$python" -m llama_cpp.server --model "$gguf" --host 127.0.0.1 --port "$port" --n_ctx "$nctx" \
        --n_threads "$threads" --n_threads_batch "$threads" --flash_attn true --verbose false "$@" \
        >"$logs/$name.log" 2>&1 &
    pids+=($!)
    wait_up "http://127.0.0.1:$port/v1/models" $!
    endpoints+=(--endpoint "$name=http://127.0.0.1:$port/v1")
}
endpoints=()
llama_server llama-cpp-python
llama_server llama-cpp-python-lookup --draft_model prompt-lookup-decoding --draft_model_num_pred_tokens "${LOOKUP_K:-10}"
port="$(free_port)"
"$python" -m verispec.apps.cli serve --backend llamacpp "${spec[@]}" --host 127.0.0.1 --port "$port" \
    --log-level warning >"$logs/verispec.log" 2>&1 &
pids+=($!)
wait_up "http://127.0.0.1:$port/health" $!
endpoints+=(--endpoint "verispec=http://127.0.0.1:$port/v1")

"$python" -m verispec.apps.cli bench "${endpoints[@]}" "${prompts[@]}" --limit "${PROMPTS:-10}" \
    --max-new-tokens "${MAX_NEW:-128}" --json-out "out/endpoint_vs_llama_server_$model.json" "$@"
