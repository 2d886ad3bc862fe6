"""An endpoint run's report (verispec.apps.bench.endpoint measures): each endpoint's runs summarised (pooled and
aggregate tokens/s, TTFT, speedups over the baseline endpoint, acceptance where the server reports it), the JSON
document, and the table for people."""

from __future__ import annotations

import hashlib
import statistics
from collections import OrderedDict

from verispec.apps.bench.endpoint import Endpoint, EndpointRun


def summarize(runs: list[EndpointRun], name: str, wall: float | None = None) -> dict:
    """One endpoint's runs (any subset): pooled tokens/s (total tokens / total seconds), pooled decode tokens/s,
    median TTFT and total time, the median request's tokens/s, speedups over the baseline endpoint, acceptance
    where the server reports it; with `wall` (the runs' wall time under load), the aggregate tokens/s."""
    mine = [r for r in runs if r.config == name]
    ok = [r for r in mine if r.ok]
    out: dict = {"prompts": len(mine), "failed": len(mine) - len(ok), "new_tokens": sum(r.new_tokens for r in ok)}
    out["aggregate_tokens_per_second"] = out["new_tokens"] / wall if wall else None
    out["request_tokens_per_second_median"] = statistics.median([r.tokens_per_second for r in ok]) if ok else None
    seconds = sum(r.seconds for r in ok)
    out["tokens_per_second"] = out["new_tokens"] / seconds if seconds else 0.0
    decoding = [r for r in ok if r.decode_tokens_per_second is not None]
    after_first = sum(r.seconds - r.ttft for r in decoding)
    out["decode_tokens_per_second"] = (sum(r.new_tokens - 1 for r in decoding) / after_first
                                       if after_first else None)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    out["ttft_median"] = statistics.median(ttfts) if ttfts else None
    out["seconds_median"] = statistics.median([r.seconds for r in ok]) if ok else None
    out["usage"] = sorted({r.usage for r in ok})
    speedups = [r.speedup for r in ok if r.speedup is not None]
    if speedups:
        out["speedup_median"] = statistics.median(speedups)
    drafted = [r for r in ok if r.drafted]
    if drafted:
        d, a = sum(r.drafted for r in drafted), sum(r.accepted or 0 for r in drafted)
        rounds = sum(r.rounds or 0 for r in drafted)
        out["acceptance_rate"] = a / d
        out["mean_accepted_length"] = (a + rounds) / rounds if rounds else None
    return out


def build_endpoint_report(runs: list[EndpointRun], endpoints: list[Endpoint], models: dict[str, str],
                          meta: dict, walls: dict[str, float] | None = None) -> dict:
    """The same document as a local bench: meta, categories, configs (kind "endpoint"; the first is the
    baseline; with `walls`, each endpoint's wall time under load), runs."""
    categories = list(OrderedDict.fromkeys(r.category for r in runs))
    report = dict(meta, baseline=endpoints[0].name, categories=categories, configs=[])
    walls = walls or {}
    for e in endpoints:
        report["configs"].append({
            "name": e.name, "kind": "endpoint", "url": e.base_url, "model": models.get(e.name),
            "wall_seconds": walls.get(e.name), "overall": summarize(runs, e.name, walls.get(e.name)),
            "by_category": {c: summarize([r for r in runs if r.category == c], e.name) for c in categories},
        })
    report["runs"] = [{k: v for k, v in r.__dict__.items() if k != "text"}
                      | {"tokens_per_second": r.tokens_per_second, "decode_tokens_per_second": r.decode_tokens_per_second,
                         "text_sha1": hashlib.sha1(r.text.encode()).hexdigest() if r.ok else None} for r in runs]
    report["failures"] = [f"{r.config} {r.prompt_id}: {r.error}" for r in runs if not r.ok]
    return report


def _fmt(value, pattern: str) -> str:
    return "-" if value is None else pattern.format(value)


def render_endpoint_table(report: dict):
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"verispec bench: endpoints ({report.get('sampling')}, max {report.get('max_new_tokens')} "
                        f"new tokens; speedup over {report.get('baseline')}, prompt by prompt)")
    loaded = any(c.get("wall_seconds") for c in report["configs"])
    if loaded:
        table.title += f"; {report.get('concurrency')} in flight"
    for col in ("endpoint", "category", "prompts", "failed", "tok/s", "decode tok/s", "TTFT (median)",
                "total (median)", "speedup (median)", "accept", "mean len", "tokens from") + (
                ("aggregate tok/s",) if loaded else ()):
        table.add_column(escape(col), justify="left" if col in ("endpoint", "category", "tokens from") else "right")
    for entry in report["configs"]:
        for cat, s in [("all", entry["overall"])] + list(entry["by_category"].items()):
            baseline = entry["name"] == report.get("baseline")
            table.add_row(
                escape(entry["name"]) if cat == "all" else "", escape(cat), str(s["prompts"]), str(s["failed"]),
                f"{s['tokens_per_second']:.2f}", _fmt(s["decode_tokens_per_second"], "{:.2f}"),
                _fmt(s["ttft_median"], "{:.3f}s"), _fmt(s["seconds_median"], "{:.2f}s"),
                "1.00x (baseline)" if baseline else _fmt(s.get("speedup_median"), "{:.2f}x"),
                _fmt(s.get("acceptance_rate"), "{:.1%}"), _fmt(s.get("mean_accepted_length"), "{:.2f}"),
                escape(",".join(s["usage"]) or "-"),
                *((_fmt(s.get("aggregate_tokens_per_second"), "{:.2f}"),) if loaded else ()),
            )
        table.add_section()
    return table
