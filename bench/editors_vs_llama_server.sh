#!/usr/bin/env bash
# Editors' requests: `verispec serve` (its default configuration) against llama-server built from the llama.cpp
# that llama-cpp-python vendors (bench/llama_server.sh), on the default target's GGUF, greedy:
#   plain      llama-server --parallel NP (default 4)
#   ngram-mod  llama-server --parallel NP --spec-type ngram-mod: its own free drafter (one n-gram pool for every slot)
#   draft      llama-server --parallel NP with the default pair's 0.5B draft (--spec-type draft-simple)
#   verispec   verispec serve (EXTRA_SERVE adds flags)
# SERVERS picks some (default: all four). Two workloads cut from HumanEval (bench/editor_workloads.py):
#   edits      whole-function edits (rename, comment, reindent; EDITS of them, default 9) streamed to
#              /v1/chat/completions by `verispec bench --endpoint --concurrency C`, MAX_NEW (default 256) tokens
#   fim        typing sessions against /infill (bench/fim_session.py): SESSIONS (default 10) single-line infills,
#              STEPS (default 6) requests each, every second one cancelled, N_PREDICT (default 32) tokens
# each at CLIENTS (default "1 4") clients at once (edits: requests in flight; fim: editors typing), each phase on a
# fresh server. Prints a table (edits: aggregate tok/s, median request tok/s; fim: median and p90 latency, first
# lines right, errors, resident memory before and after; the answers equal to llama-server plain's at the same
# clients) and one JSON line; the reports land in out/editors_vs_llama_server/. KERNELS as bench/llama_server.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
python="${PYTHON:-python}"
np="${NP:-4}"
threads="$(nproc)"
out="out/editors_vs_llama_server"
work="$out/workloads"
mkdir -p "$out" "$work"
# shellcheck source=bench/llama_server.sh
. bench/llama_server.sh
trap server_stop EXIT

"$python" bench/editor_workloads.py --out "$work" --problems "${SESSIONS:-10}" --edits "${EDITS:-9}" >/dev/null
target="$("$python" -c "from verispec.backends.loading import resolve_gguf; from verispec.catalog import DEFAULT_TARGET as t; print(resolve_gguf(t))")"
draft="$("$python" -c "from verispec.backends.loading import resolve_gguf; from verispec.catalog import DEFAULT_DRAFT as d; print(resolve_gguf(d))")"
llama_server_build "${KERNELS:-stock}"
llama=("$llama_server" -m "$target" -np "$np" -c $((np * 4096)) -t "$threads" -tb "$threads" -fa on --no-webui)

start() {  # server name
    case "$1" in
        plain) server_start "$1" "${llama[@]}" ;;
        ngram-mod) server_start "$1" "${llama[@]}" --spec-type ngram-mod ;;
        draft) server_start "$1" "${llama[@]}" -md "$draft" --spec-type draft-simple ;;
        # shellcheck disable=SC2086
        verispec) server_start "$1" "$python" -m verispec.apps.cli serve --log-level warning ${EXTRA_SERVE:-} ;;
        *) echo "unknown server '$1' (plain, ngram-mod, draft, verispec)" >&2; exit 2 ;;
    esac
}
for c in ${CLIENTS:-1 4}; do
    for name in ${SERVERS:-plain ngram-mod draft verispec}; do
        start "$name"
        "$python" -m verispec.apps.cli bench --endpoint "$name=$url/v1" --concurrency "$c" --prompts "$work/edits.jsonl" \
            --max-new-tokens "${MAX_NEW:-256}" --warmup 1 --json-out "$out/edits-$name-c$c.json" >/dev/null
        server_stop
        start "$name"
        "$python" bench/fim_session.py "$url" --workload "$work/fim_line.jsonl" --editors "$c" \
            --sessions "${SESSIONS:-10}" --steps "${STEPS:-6}" --n-predict "${N_PREDICT:-32}" --pid "$pid" \
            --json-out "$out/fim-$name-c$c.json" >/dev/null
        server_stop
    done
done

"$python" - "$out" <<'EOF'
import glob, json, os, sys
out = sys.argv[1]
edits, fims = {}, {}
for path in glob.glob(os.path.join(out, "edits-*-c*.json")):
    report = json.load(open(path))
    edits[(report["configs"][0]["name"], report["concurrency"])] = report
for path in glob.glob(os.path.join(out, "fim-*-c*.json")):
    name, c = os.path.basename(path)[4:-5].rsplit("-c", 1)
    fims[(name, int(c))] = json.load(open(path))
order = ["plain", "ngram-mod", "draft", "verispec"]
fmt = lambda v, p: "-" if v is None else p.format(v)
rows = []
print(f"{'server':10} {'clients':>7} | {'edits tok/s':>11} {'req tok/s':>9} {'as plain':>8} | {'fim median':>10} "
      f"{'p90':>7} {'1st line':>8} {'as plain':>8} {'errors':>6} {'RSS MiB':>11}")
for c in sorted({c for _, c in list(edits) + list(fims)}):
    for name in sorted({n for n, cc in list(edits) + list(fims) if cc == c}, key=lambda n: order.index(n) if n in order else 9):
        row = {"server": name, "clients": c}
        e, base = edits.get((name, c)), edits.get(("plain", c))
        if e:
            o = e["configs"][0]["overall"]
            texts = {r["prompt_id"]: r["text_sha1"] for r in e["runs"]}
            plain = {r["prompt_id"]: r["text_sha1"] for r in base["runs"]} if base else {}
            row.update(edits_tokens_per_second=o["aggregate_tokens_per_second"],
                       edits_request_tokens_per_second=o["request_tokens_per_second_median"], edits_failed=o["failed"],
                       edits_as_plain=f"{sum(plain.get(p) == h for p, h in texts.items())}/{len(texts)}" if base else None)
        f, fbase = fims.get((name, c)), fims.get(("plain", c))
        if f:
            mine = {(x["problem"], x["step"]): x["content"] for x in f["completions"]}
            plain = {(x["problem"], x["step"]): x["content"] for x in fbase["completions"]} if fbase else {}
            shared = [k for k in mine if k in plain]
            row.update(fim_latency_median=f["latency_median"], fim_latency_p90=f["latency_p90"],
                       fim_first_line=f["first_line_accuracy"], fim_errors=f["errors"], fim_completed=f["completed"],
                       fim_as_plain=f"{sum(mine[k] == plain[k] for k in shared)}/{len(shared)}" if fbase else None,
                       rss_before=f["rss_before"], rss_after=f["rss_after"])
        rows.append(row)
        mib = lambda v: "-" if v is None else f"{v / 2**20:.0f}"
        print(f"{name:10} {c:>7} | {fmt(row.get('edits_tokens_per_second'), '{:.2f}'):>11} "
              f"{fmt(row.get('edits_request_tokens_per_second'), '{:.2f}'):>9} {row.get('edits_as_plain') or '-':>8} | "
              f"{fmt(row.get('fim_latency_median'), '{:.3f}s'):>10} {fmt(row.get('fim_latency_p90'), '{:.2f}s'):>7} "
              f"{fmt(row.get('fim_first_line'), '{:.0%}'):>8} {row.get('fim_as_plain') or '-':>8} "
              f"{fmt(row.get('fim_errors'), '{}'):>6} {mib(row.get('rss_before')) + '->' + mib(row.get('rss_after')):>11}")
by = {(r["server"], r["clients"]): r for r in rows}
ratios = {}
for (name, c), r in by.items():
    if name == "verispec":
        continue
    v = by.get(("verispec", c), {})
    if r.get("edits_tokens_per_second") and v.get("edits_tokens_per_second"):
        ratios[f"edits verispec/{name} c{c}"] = v["edits_tokens_per_second"] / r["edits_tokens_per_second"]
    if r.get("fim_latency_median") and v.get("fim_latency_median"):
        ratios[f"fim latency verispec/{name} c{c}"] = v["fim_latency_median"] / r["fim_latency_median"]
for c in sorted({c for _, c in by}):
    one, many = by.get(("verispec", 1), {}), by.get(("verispec", c), {})
    if c > 1 and one.get("edits_tokens_per_second") and many.get("edits_tokens_per_second"):
        ratios[f"edits verispec c{c}/c1"] = many["edits_tokens_per_second"] / one["edits_tokens_per_second"]
for key, value in ratios.items():
    print(f"{key}: {value:.2f}x")
print(json.dumps({"rows": rows, "ratios": ratios}))
EOF
