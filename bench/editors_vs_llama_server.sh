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
# fresh server; WORKLOADS (default "edits fim") picks some. REPEATS=N (default 1) runs every phase N times, the
# servers' order reversed every other time so that the machine's drift falls on all of them alike; the speeds and
# latencies in the table are medians over the repeats, failures and errors their sums, and each ratio the median
# of the repeats' ratios (all of them printed). Prints a table (edits: aggregate tok/s, median request tok/s; fim:
# median and p90 latency, first lines right, errors, resident memory before and after; first lines, memory and the
# answers equal to llama-server plain's at the same clients from the first repeat) and one JSON line; the reports
# land in out/editors_vs_llama_server/ (a run replaces those of the servers, clients and workloads it measures;
# the others stay and are read with it). KERNELS as bench/llama_server.sh.
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
read -r -a servers <<< "${SERVERS:-plain ngram-mod draft verispec}"
for c in ${CLIENTS:-1 4}; do
    for name in "${servers[@]}"; do
        for workload in ${WORKLOADS:-edits fim}; do
            rm -f "$out/$workload-$name-c$c"-r*.json
        done
    done
done
for r in $(seq "${REPEATS:-1}"); do
    order=("${servers[@]}")
    if ((r % 2 == 0)); then
        for ((i = 0; i < ${#servers[@]}; i++)); do order[i]=${servers[${#servers[@]} - 1 - i]}; done
    fi
    for c in ${CLIENTS:-1 4}; do
        for name in "${order[@]}"; do
            if [[ " ${WORKLOADS:-edits fim} " == *" edits "* ]]; then
                start "$name"
                "$python" -m verispec.apps.cli bench --endpoint "$name=$url/v1" --concurrency "$c" \
                    --prompts "$work/edits.jsonl" --max-new-tokens "${MAX_NEW:-256}" --warmup 1 \
                    --json-out "$out/edits-$name-c$c-r$r.json" >/dev/null
                server_stop
            fi
            if [[ " ${WORKLOADS:-edits fim} " == *" fim "* ]]; then
                start "$name"
                "$python" bench/fim_session.py "$url" --workload "$work/fim_line.jsonl" --editors "$c" \
                    --sessions "${SESSIONS:-10}" --steps "${STEPS:-6}" --n-predict "${N_PREDICT:-32}" --pid "$pid" \
                    --json-out "$out/fim-$name-c$c-r$r.json" >/dev/null
                server_stop
            fi
        done
    done
done

"$python" - "$out" <<'EOF'
import glob, json, os, re, statistics, sys
out = sys.argv[1]
reports = {}  # (workload, server, clients) -> {repeat: report}
for path in glob.glob(os.path.join(out, "*.json")):
    m = re.fullmatch(r"(edits|fim)-(.+)-c(\d+)-r(\d+)\.json", os.path.basename(path))
    if m:
        reports.setdefault((m[1], m[2], int(m[3])), {})[int(m[4])] = json.load(open(path))
def median(values):
    """The median of the values measured (a phase where nothing completed has none), or None."""
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


first = lambda runs: runs[min(runs)] if runs else None
order = ["plain", "ngram-mod", "draft", "verispec"]
fmt = lambda v, p: "-" if v is None else p.format(v)
overall = lambda e: e["configs"][0]["overall"]
fim_latency = lambda f: f["latency_median"]
rows = []
print(f"{'server':10} {'clients':>7} | {'edits tok/s':>11} {'req tok/s':>9} {'as plain':>8} | {'fim median':>10} "
      f"{'p90':>7} {'1st line':>8} {'as plain':>8} {'errors':>6} {'RSS MiB':>11} | {'repeats':>7}")
keys = {(name, c) for _, name, c in reports}
for c in sorted({c for _, c in keys}):
    for name in sorted({n for n, cc in keys if cc == c}, key=lambda n: order.index(n) if n in order else 9):
        row = {"server": name, "clients": c}
        es, fs = reports.get(("edits", name, c), {}), reports.get(("fim", name, c), {})
        e, base = first(es), first(reports.get(("edits", "plain", c), {}))
        if e:
            texts = {r["prompt_id"]: r["text_sha1"] for r in e["runs"]}
            plain = {r["prompt_id"]: r["text_sha1"] for r in base["runs"]} if base else {}
            row.update(edits_tokens_per_second=median([overall(x)["aggregate_tokens_per_second"] for x in es.values()]),
                       edits_request_tokens_per_second=median([overall(x)["request_tokens_per_second_median"]
                                                               for x in es.values()]),
                       edits_failed=sum(overall(x)["failed"] for x in es.values()),
                       edits_as_plain=f"{sum(plain.get(p) == h for p, h in texts.items())}/{len(texts)}" if base
                       else None)
        f, fbase = first(fs), first(reports.get(("fim", "plain", c), {}))
        if f:
            mine = {(x["problem"], x["step"]): x["content"] for x in f["completions"]}
            plain = {(x["problem"], x["step"]): x["content"] for x in fbase["completions"]} if fbase else {}
            shared = [k for k in mine if k in plain]
            row.update(fim_latency_median=median([fim_latency(x) for x in fs.values()]),
                       fim_latency_p90=median([x["latency_p90"] for x in fs.values()]),
                       fim_first_line=f["first_line_accuracy"], fim_errors=sum(x["errors"] for x in fs.values()),
                       fim_completed=sum(x["completed"] for x in fs.values()),
                       fim_as_plain=f"{sum(mine[k] == plain[k] for k in shared)}/{len(shared)}" if fbase else None,
                       rss_before=f["rss_before"], rss_after=f["rss_after"])
        row["repeats"] = max(len(es), len(fs))
        rows.append(row)
        mib = lambda v: "-" if v is None else f"{v / 2**20:.0f}"
        rss = "-" if f is None else f"{mib(row['rss_before'])}->{mib(row['rss_after'])}"
        print(f"{name:10} {c:>7} | {fmt(row.get('edits_tokens_per_second'), '{:.2f}'):>11} "
              f"{fmt(row.get('edits_request_tokens_per_second'), '{:.2f}'):>9} {row.get('edits_as_plain') or '-':>8} | "
              f"{fmt(row.get('fim_latency_median'), '{:.3f}s'):>10} {fmt(row.get('fim_latency_p90'), '{:.2f}s'):>7} "
              f"{fmt(row.get('fim_first_line'), '{:.0%}'):>8} {row.get('fim_as_plain') or '-':>8} "
              f"{fmt(row.get('fim_errors'), '{}'):>6} {rss:>11} | {row['repeats']:>7}")


def per_repeat(workload, a, b, value):
    """value(a's report) / value(b's) for each repeat in which both were measured (and are not None or 0)."""
    ra, rb = reports.get((workload, *a), {}), reports.get((workload, *b), {})
    return [value(ra[r]) / value(rb[r]) for r in sorted(ra) if r in rb and value(ra[r]) and value(rb[r])]


each = {}
for name, c in sorted(keys):
    if name != "verispec":
        for label, workload, value in (("edits", "edits", lambda x: overall(x)["aggregate_tokens_per_second"]),
                                       ("fim latency", "fim", fim_latency)):
            got = per_repeat(workload, ("verispec", c), (name, c), value)
            if got:
                each[f"{label} verispec/{name} c{c}"] = got
for c in sorted({c for _, c in keys}):
    got = per_repeat("edits", ("verispec", c), ("verispec", 1), lambda x: overall(x)["aggregate_tokens_per_second"])
    if c > 1 and got:
        each[f"edits verispec c{c}/c1"] = got
ratios = {key: statistics.median(values) for key, values in each.items()}
for key, values in each.items():
    print(f"{key}: {ratios[key]:.2f}x" + (f" ({', '.join(f'{v:.2f}' for v in values)})" if len(values) > 1 else ""))
print(json.dumps({"rows": rows, "ratios": ratios, "repeat_ratios": each}))
EOF
