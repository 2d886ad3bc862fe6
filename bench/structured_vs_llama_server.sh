#!/usr/bin/env bash
# Structured output: `verispec serve` (its default configuration) against llama-server built from the llama.cpp that
# llama-cpp-python vendors (bench/llama_server.sh), on the default target's GGUF, greedy, one request at a time:
#   plain      llama-server --jinja (json_schema through its GBNF, tools through the chat template)
#   ngram-mod  llama-server --jinja --spec-type ngram-mod: its own free drafter
#   verispec   verispec serve (EXTRA_SERVE adds flags)
# SERVERS picks some (default: all three), each on a fresh server. The requests are bench/structured_output.py's (N,
# default 30: extraction and planning under a JSON schema, tool calls with tool_choice required; KINDS picks some of
# extract,plan,tool; MAX_NEW tokens, default 256). Prints each server's tok/s (end to end), answers valid and answers
# equal to llama-server plain's, and the ratios of verispec's tok/s; the records land in
# out/structured_vs_llama_server/. KERNELS as bench/llama_server.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
threads="$(nproc)"
out="out/structured_vs_llama_server"
mkdir -p "$out"
# shellcheck source=bench/llama_server.sh
. bench/llama_server.sh
trap server_stop EXIT

target="$("$python" -c "from verispec.backends.loading import resolve_gguf; from verispec.catalog import DEFAULT_TARGET as t; print(resolve_gguf(t))")"
llama_server_build "${KERNELS:-stock}"
llama=("$llama_server" -m "$target" -np 1 -c 8192 -t "$threads" -tb "$threads" -fa on --no-webui --jinja)
for name in ${SERVERS:-plain ngram-mod verispec}; do
    case "$name" in
        plain) server_start "$name" "${llama[@]}" ;;
        ngram-mod) server_start "$name" "${llama[@]}" --spec-type ngram-mod ;;
        # shellcheck disable=SC2086
        verispec) server_start "$name" "$python" -m verispec.apps.cli serve --log-level warning ${EXTRA_SERVE:-} ;;
        *) echo "unknown server '$name' (plain, ngram-mod, verispec)" >&2; exit 2 ;;
    esac
    "$python" bench/structured_output.py --endpoint "$url/v1" --n "${N:-30}" --max-new-tokens "${MAX_NEW:-256}" \
        --kinds "${KINDS:-extract,plan,tool}" --json "$out/$name.json" > "$out/$name.txt"
    server_stop
    tail -1 "$out/$name.txt" | sed "s/^/$name /"
done

"$python" - "$out" <<'PY'
import json, os, sys
out = sys.argv[1]
runs = {n[:-5]: json.load(open(os.path.join(out, n))) for n in os.listdir(out) if n.endswith(".json")}
speed = {n: sum(r["tokens"] for r in rs) / sum(r["seconds"] for r in rs) for n, rs in runs.items()}
plain = {r["request"]: r["answer"] for r in runs.get("plain", [])}
for name, rs in runs.items():
    same = sum(plain.get(r["request"]) == r["answer"] for r in rs) if plain else None
    print(f"{name:10} {speed[name]:7.2f} tok/s  valid {sum(r['valid'] for r in rs)}/{len(rs)}  "
          f"as llama-server plain {same}/{len(rs)}")
ratios = {f"verispec/{n}": speed["verispec"] / speed[n] for n in speed if n != "verispec" and "verispec" in speed}
for key, value in ratios.items():
    print(f"{key}: {value:.2f}x")
print(json.dumps({"tokens_per_second": speed, "ratios": ratios}))
PY
