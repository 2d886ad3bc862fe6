"""Aggregate benchmark runs: speedups, time to first token, acceptance, cost ratio c, α, the Leviathan bound;
table, JSON, plots. Failed runs are listed and counted, and left out of every aggregate.

Leviathan et al. (2023): with per-token acceptance α, k drafts per round and a draft/target cost ratio c,
the expected speedup is S(α, k, c) = (1 − α^(k+1)) / ((1 − α)(k·c + 1)). We measure c from the run's own
timings (mean draft forward / mean target verify forward) and α from the measured mean tokens per round
(accepted + 1), which under the i.i.d. model equals (1 − α^(k+1)) / (1 − α).
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from pathlib import Path

from verispec.bench.harness import Config, Run


def leviathan_bound(alpha: float, k: int, c: float) -> float:
    """S(α, k, c) = (1 − α^(k+1)) / ((1 − α)(k·c + 1)); at α = 1 the first factor is k + 1."""
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")
    tokens_per_round = k + 1.0 if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    return tokens_per_round / (k * c + 1.0)


def alpha_from_mean_length(mean_length: float, k: int) -> float:
    """Invert E[tokens per round] = (1 − α^(k+1)) / (1 − α) (increasing in α) by bisection."""
    if k == 0 or mean_length <= 1.0:
        return 0.0
    if mean_length >= k + 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if (1 - mid ** (k + 1)) / (1 - mid) < mean_length:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def _quantile(values: list[float], q: float) -> float:
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _tokens_per_second(runs: list[Run]) -> float:
    seconds = sum(r.seconds for r in runs)
    return sum(r.new_tokens for r in runs) / seconds if seconds else 0.0


def _decode_tokens_per_second(runs: list[Run]) -> float | None:
    """Pooled tokens/s after each run's first token, over the runs that measured it."""
    decoding = [r for r in runs if r.decode_tokens_per_second is not None]
    after_first = sum(r.seconds - r.ttft * r.repeats for r in decoding)
    return sum(r.new_tokens - r.first_tokens for r in decoding) / after_first if after_first > 0 else None


def summarize(runs: list[Run], config: Config) -> dict:
    """Aggregate one configuration's runs (any subset: a category or all); failed runs are counted, never
    measured. speedup_aggregate: this configuration's total tokens/s over the baseline's on the same prompts.
    ttft_median: the median over prompts of the time to the first token (None where not measured)."""
    every = [r for r in runs if r.config == config.name]
    mine = [r for r in every if r.ok]
    out: dict = {"prompts": len(every), "failed": len(every) - len(mine),
                 "new_tokens": sum(r.new_tokens for r in mine), "repeats": max((r.repeats for r in mine), default=1)}
    out["tokens_per_second"] = _tokens_per_second(mine)
    out["decode_tokens_per_second"] = _decode_tokens_per_second(mine)
    ttfts = [r.ttft for r in mine if r.ttft is not None]
    out["ttft_median"] = statistics.median(ttfts) if ttfts else None
    compared = [r for r in mine if r.speedup is not None]
    if compared:
        speedups = [r.speedup for r in compared]
        prompt_ids = {r.prompt_id for r in compared}
        base = _tokens_per_second([r for r in runs if r.config == "plain" and r.ok and r.prompt_id in prompt_ids])
        out.update(speedup_median=statistics.median(speedups), speedup_p25=_quantile(speedups, 0.25),
                   speedup_p75=_quantile(speedups, 0.75), speedup_min=min(speedups), speedup_max=max(speedups),
                   speedup_aggregate=_tokens_per_second(compared) / base if base else 0.0)
    checked = [r for r in mine if r.identical is not None]
    if checked:
        out["identity"] = {
            "checked": len(checked),
            "mismatches": sum(not r.identical for r in checked),
            "first_diff": {r.prompt_id: r.first_diff for r in checked if not r.identical},
        }
    if config.kind == "spec":
        drafted, accepted, rounds = (sum(getattr(r, a) for r in mine) for a in ("drafted", "accepted", "rounds"))
        out["acceptance_rate"] = accepted / drafted if drafted else 0.0
        out["mean_accepted_length"] = (accepted + rounds) / rounds if rounds else 0.0
        width = max((len(r.drafted_per_position) for r in mine), default=0)
        per_pos = []
        for i in range(width):
            d = sum(r.drafted_per_position[i] for r in mine if i < len(r.drafted_per_position))
            a = sum(r.accepted_per_position[i] for r in mine if i < len(r.accepted_per_position))
            per_pos.append(a / d if d else 0.0)
        out["acceptance_by_position"] = per_pos
        d_fwd, t_fwd = sum(r.draft_forwards for r in mine), sum(r.target_forwards for r in mine)
        d_sec, t_sec = sum(r.draft_seconds for r in mine), sum(r.target_seconds for r in mine)
        c = (d_sec / d_fwd) / (t_sec / t_fwd) if d_fwd and t_fwd and t_sec else 0.0
        out["cost_ratio_c"] = c
        if isinstance(config.k, int):  # the bound needs a fixed k
            alpha = alpha_from_mean_length(out["mean_accepted_length"], config.k)
            bound = leviathan_bound(alpha, config.k, c)
            out.update(alpha=alpha, bound=bound, efficiency=(out.get("speedup_median", 0.0) / bound) if bound else 0.0)
    return out


def build_report(runs: list[Run], configs: list[Config], meta: dict) -> dict:
    categories = list(OrderedDict.fromkeys(r.category for r in runs))
    report = dict(meta)
    report["categories"] = categories
    report["configs"] = []
    for config in [Config("plain", "plain")] + [c for c in configs if c.kind != "plain"]:
        entry = {"name": config.name, "kind": config.kind, "k": config.k, "drafter": config.drafter,
                 "overall": summarize(runs, config)}
        entry["by_category"] = {cat: summarize([r for r in runs if r.category == cat], config) for cat in categories}
        report["configs"].append(entry)
    report["runs"] = [
        {k: v for k, v in r.__dict__.items() if k != "token_ids"}
        | {"tokens_per_second": r.tokens_per_second, "decode_tokens_per_second": r.decode_tokens_per_second}
        for r in runs
    ]
    report["failures"] = [f"{r.config} {r.prompt_id}: {r.error}" for r in runs if not r.ok]
    return report


def render_table(report: dict):
    from rich.markup import escape
    from rich.table import Table

    backends = f" [{report.get('backend', 'hf')} <- {report.get('draft_backend') or '-'}]"
    table = Table(title=f"verispec bench: {report.get('target')} <- {report.get('draft')}{backends}  "
                        f"({report.get('device')}, {report.get('dtype')}, {report.get('sampling')}"
                        + (f", {report['repeats']} runs per prompt pooled" if report.get("repeats", 1) > 1 else "") + ")")
    for col in ("config", "category", "prompts", "failed", "tok/s", "decode tok/s", "TTFT (median)",
                "speedup (median [p25-p75])", "min", "agg.", "accept", "mean len", "c", "alpha", "bound", "eff.",
                "identical"):
        table.add_column(escape(col), justify="left" if col in ("config", "category") else "right")
    for entry in report["configs"]:
        rows = [("all", entry["overall"])] + list(entry["by_category"].items())
        for cat, s in rows:
            speed = (f"{s['speedup_median']:.2f}x [{s['speedup_p25']:.2f}-{s['speedup_p75']:.2f}]"
                     if "speedup_median" in s else "1.00x (baseline)" if entry["kind"] == "plain" else "-")
            ident = s.get("identity")
            table.add_row(
                escape(entry["name"]) if cat == "all" else "", escape(cat), str(s["prompts"]), str(s["failed"]),
                f"{s['tokens_per_second']:.2f}",
                "-" if s["decode_tokens_per_second"] is None else f"{s['decode_tokens_per_second']:.2f}",
                "-" if s["ttft_median"] is None else f"{s['ttft_median']:.3f}s", escape(speed),
                f"{s['speedup_min']:.2f}x" if "speedup_min" in s else "-",
                f"{s['speedup_aggregate']:.2f}x" if "speedup_aggregate" in s else "-",
                f"{s['acceptance_rate']:.1%}" if "acceptance_rate" in s else "-",
                f"{s['mean_accepted_length']:.2f}" if "mean_accepted_length" in s else "-",
                f"{s['cost_ratio_c']:.3f}" if "cost_ratio_c" in s else "-",
                f"{s['alpha']:.3f}" if "alpha" in s else "-",
                f"{s['bound']:.2f}x" if "bound" in s else "-",
                f"{s['efficiency']:.2f}" if "efficiency" in s else "-",
                f"{ident['checked'] - ident['mismatches']}/{ident['checked']}" if ident else "-",
            )
        table.add_section()
    return table


def write_plots(report: dict, plot_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    others = [e for e in report["configs"] if e["kind"] != "plain"]
    cats = report["categories"]
    paths = []

    def save(fig, ax, title: str, ylabel: str, name: str) -> None:
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.legend()
        fig.tight_layout()
        paths.append(plot_dir / name)
        fig.savefig(paths[-1])
        plt.close(fig)

    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(others))), 4))
    width = 0.8 / max(1, len(others))
    for j, e in enumerate(others):
        ys = [e["by_category"][c].get("speedup_median", 0.0) for c in cats]
        ax.bar([i + j * width for i in range(len(cats))], ys, width, label=e["name"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(others) - 1) / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    save(fig, ax, "Speedup by category", "speedup over plain decoding (median)", "speedup_by_category.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for e in others:
        per_pos = e["overall"].get("acceptance_by_position") or []
        if per_pos:
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=e["name"])
    ax.set_xlabel("draft position")
    ax.set_ylim(0, 1.02)
    save(fig, ax, "Acceptance by draft position", "P(accepted | reached)", "acceptance_by_position.png")

    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter in dict.fromkeys(e["drafter"] for e in others if e["kind"] == "spec"):
        spec = sorted((e for e in others if e["kind"] == "spec" and e["drafter"] == drafter and isinstance(e["k"], int)),
                      key=lambda e: e["k"])
        ks = [e["k"] for e in spec]
        ax.plot(ks, [e["overall"].get("speedup_median", 0.0) for e in spec], marker="o", label=f"{drafter} measured")
        if drafter == "model":
            ax.plot(ks, [e["overall"].get("bound", 0.0) for e in spec], marker="x", linestyle="--",
                    label="Leviathan bound")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("k (draft tokens per round)")
    save(fig, ax, "Speedup vs k", "speedup over plain decoding", "speedup_vs_k.png")
    return paths
