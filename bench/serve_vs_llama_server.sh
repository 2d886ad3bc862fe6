#!/usr/bin/env bash
# verispec serve against llama.cpp's own llama-server under concurrent load, on the same GGUF.
#
# llama-server is built from the llama.cpp source that llama-cpp-python's sdist vendors (the commit verispec runs;
# KERNELS=verispec builds it with native/llama.cpp-kernels.patch applied, to tell verispec's kernels apart from its
# scheduling), once, under $VERISPEC_HOME/llama-server. Then for each concurrency (CONCURRENCY, default "1 4 8")
# each server runs alone on a fresh start (verispec's suffix drafter remembers earlier answers; no two servers
# share the cores while one is measured): llama-server --parallel NP (default 4) plain, llama-server --parallel NP
# with the default pair's draft model (--spec-type draft-simple), and `verispec serve` in its default configuration
# (EXTRA_SERVE adds flags); SERVERS (default "plain draft verispec") picks which of the three run. Each is driven
# by `verispec bench --endpoint --concurrency C` on the same prompts: SET mt_bench (default: first turns, short
# prompts, so decoding dominates), spec_bench (long prompts too: RAG and summaries, so prefills weigh) or
# humaneval; PROMPTS (default 16), PER_CATEGORY (default 2) per category, MAX_NEW (default 128) new tokens, greedy.
# Prints a table (aggregate tokens/s, median TTFT, median per-request tokens/s, and ratios) and one JSON line; the
# per-run reports land in out/serve_vs_llama_server/SET/. BUILD_ONLY=1: build llama-server and stop.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
data="${BENCH_DATA:-../shared/bench-data}"
kernels="${KERNELS:-stock}"
np="${NP:-4}"
threads="$(nproc)"
set_name="${SET:-mt_bench}"
case "$set_name" in
    mt_bench) prompts=(--prompts "$data/mt_bench_question.jsonl") ;;
    spec_bench) prompts=(--prompts "$data/spec_bench_question.jsonl") ;;
    humaneval) prompts=(--prompts "$data/HumanEval.jsonl.gz") ;;
    *) echo "unknown SET '$set_name' (mt_bench, spec_bench, humaneval)" >&2; exit 2 ;;
esac
out="out/serve_vs_llama_server/$set_name"
mkdir -p "$out"
# shellcheck source=bench/llama_server.sh
. bench/llama_server.sh
trap server_stop EXIT

target="$("$python" -c "from verispec.backends.loading import resolve_gguf; from verispec.catalog import DEFAULT_TARGET as t; print(resolve_gguf(t))")"
draft="$("$python" -c "from verispec.backends.loading import resolve_gguf; from verispec.catalog import DEFAULT_DRAFT as d; print(resolve_gguf(d))")"
llama_server_build "$kernels"
[ -z "${BUILD_ONLY:-}" ] || exit 0

llama=("$llama_server" -m "$target" -np "$np" -c $((np * 4096)) -t "$threads" -tb "$threads" -fa on --no-webui)
run() {  # name, concurrency
    "$python" -m verispec.apps.cli bench --endpoint "$1=$url/v1" --concurrency "$2" "${prompts[@]}" \
        --per-category "${PER_CATEGORY:-2}" --limit "${PROMPTS:-16}" --max-new-tokens "${MAX_NEW:-128}" --warmup 1 \
        --json-out "$out/$1-c$2.json" >/dev/null
    server_stop
}
servers=" ${SERVERS:-plain draft verispec} "
for c in ${CONCURRENCY:-1 4 8}; do
    if [[ "$servers" == *" plain "* ]]; then
        server_start "llama-server-np$np" "${llama[@]}"
        run "llama-server-np$np" "$c"
    fi
    if [[ "$servers" == *" draft "* ]]; then
        server_start "llama-server-np$np-draft" "${llama[@]}" -md "$draft" --spec-type draft-simple
        run "llama-server-np$np-draft" "$c"
    fi
    if [[ "$servers" == *" verispec "* ]]; then
        # shellcheck disable=SC2086
        server_start verispec "$python" -m verispec.apps.cli serve --log-level warning ${EXTRA_SERVE:-}
        run verispec "$c"
    fi
done

"$python" - "$out" "$np" "$kernels" "$set_name" <<'EOF'
import glob, json, os, sys
out, np, kernels, set_name = sys.argv[1:5]
rows, texts = {}, {}
for path in sorted(glob.glob(os.path.join(out, "*-c*.json"))):
    report = json.load(open(path))
    o = report["configs"][0]["overall"]
    key = (report["configs"][0]["name"], report["concurrency"])
    rows[key] = o
    texts[key] = {r["prompt_id"]: r.get("text_sha1") for r in report["runs"]}
names = sorted({n for n, _ in rows}, key=lambda n: (n == "verispec", n))
cs = sorted({c for _, c in rows})
print(f"{'server':28} {'conc':>4} {'agg tok/s':>10} {'x own c=1':>9} {'TTFT med':>9} {'req tok/s':>9} {'verispec x':>10} "
      f"{'as alone':>8}")
summary = []
for c in cs:
    for n in names:
        o = rows.get((n, c))
        if o is None:
            continue
        one = rows.get((n, 1), {}).get("aggregate_tokens_per_second")
        mine = rows.get(("verispec", c), {}).get("aggregate_tokens_per_second")
        agg = o["aggregate_tokens_per_second"]
        alone = texts.get((n, 1), {})
        same = sum(alone.get(p) is not None and alone.get(p) == h for p, h in texts[(n, c)].items())
        entry = {"server": n, "concurrency": c, "aggregate_tokens_per_second": agg, "ttft_median": o["ttft_median"],
                 "answers_as_alone": f"{same}/{len(texts[(n, c)])}",
                 "request_tokens_per_second_median": o["request_tokens_per_second_median"],
                 "vs_own_concurrency_1": agg / one if one else None, "verispec_vs_this": mine / agg if mine else None,
                 "failed": o["failed"], "acceptance_rate": o.get("acceptance_rate")}
        summary.append(entry)
        fmt = lambda v, p: "-" if v is None else p.format(v)
        print(f"{n:28} {c:>4} {agg:>10.2f} {fmt(entry['vs_own_concurrency_1'], '{:.2f}x'):>9} "
              f"{fmt(o['ttft_median'], '{:.3f}s'):>9} {fmt(o['request_tokens_per_second_median'], '{:.2f}'):>9} "
              f"{fmt(entry['verispec_vs_this'], '{:.2f}x'):>10} {entry['answers_as_alone']:>8}")
print(json.dumps({"set": set_name, "llama_server_parallel": int(np), "llama_server_kernels": kernels,
                  "rows": summary}))
EOF
