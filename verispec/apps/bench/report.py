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

from verispec.apps.bench.harness import Config, Run


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
        # drafts per round, every round counted (k = auto may choose plain rounds: k = 0); the runs' timelines
        # have one entry per round that committed tokens
        all_rounds = sum(len(r.timeline) or r.rounds for r in mine)
        out["mean_k"] = drafted / all_rounds if all_rounds else 0.0
        lengths = [n for r in mine for n in r.accepted_lengths]
        out["accepted_length_counts"] = [lengths.count(n) for n in range(max(lengths, default=-1) + 1)]
        d_fwd, t_fwd = sum(r.draft_forwards for r in mine), sum(r.target_forwards for r in mine)
        d_sec, t_sec = sum(r.draft_seconds for r in mine), sum(r.target_seconds for r in mine)
        c = (d_sec / d_fwd) / (t_sec / t_fwd) if d_fwd and t_fwd and t_sec else 0.0
        out["cost_ratio_c"] = c
        if isinstance(config.k, int):  # the bound needs a fixed k
            alpha = alpha_from_mean_length(out["mean_accepted_length"], config.k)
            bound = leviathan_bound(alpha, config.k, c)
            out.update(alpha=alpha, bound=bound, efficiency=(out.get("speedup_median", 0.0) / bound) if bound else 0.0)
    return out


def timeline(runs: list[Run]) -> dict | None:
    """Tokens committed over time in one generation, per configuration, for one prompt: the first whose plain
    run recorded its rounds. {"prompt_id", "configs": {name: [[seconds, tokens so far], ...]}}, or None."""
    prompt_id = next((r.prompt_id for r in runs if r.config == "plain" and r.ok and r.timeline), None)
    if prompt_id is None:
        return None
    return {"prompt_id": prompt_id, "configs": {r.config: [list(point) for point in r.timeline] for r in runs
                                                if r.prompt_id == prompt_id and r.ok and r.timeline}}


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
        {k: v for k, v in r.__dict__.items() if k not in ("token_ids", "accepted_lengths", "timeline")}
        | {"tokens_per_second": r.tokens_per_second, "decode_tokens_per_second": r.decode_tokens_per_second}
        for r in runs
    ]
    report["timeline"] = timeline(runs)
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


PLOTS = ("speedup_by_category.png", "accepted_length_histogram.png", "acceptance_by_position.png",
         "tokens_over_time.png", "speedup_vs_k.png")


def write_plots(report: dict, plot_dir: str | Path) -> list[Path]:
    """Write the PLOTS (PNG) into plot_dir and return their paths. A plot with nothing to show says so."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plot_dir = Path(plot_dir)
    plot_dir.mkdir(parents=True, exist_ok=True)
    others = [e for e in report["configs"] if e["kind"] != "plain"]
    spec = [e for e in others if e["kind"] == "spec"]
    paths = []

    def save(fig, ax, title: str, ylabel: str, name: str) -> None:
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        else:
            ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes)
        fig.tight_layout()
        paths.append(plot_dir / name)
        fig.savefig(paths[-1])
        plt.close(fig)

    _speedup_by_category(plt, save, others, report["categories"])
    _accepted_length_histogram(plt, save, spec)
    _acceptance_by_position(plt, save, others)
    _tokens_over_time(plt, save, report.get("timeline"))
    _speedup_vs_k(plt, save, spec)
    return paths


def _speedup_by_category(plt, save, others: list[dict], cats: list[str]) -> None:
    """Median speedup per category and configuration, error bars from p25 to p75 over the prompts."""
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(cats) * max(1, len(others))), 4))
    width = 0.8 / max(1, len(others))
    for j, e in enumerate(others):
        stats = [e["by_category"][c] for c in cats]
        ys = [s.get("speedup_median", 0.0) for s in stats]
        low = [y - s.get("speedup_p25", y) for y, s in zip(ys, stats)]
        high = [s.get("speedup_p75", y) - y for y, s in zip(ys, stats)]
        ax.bar([i + j * width for i in range(len(cats))], ys, width, yerr=[low, high], capsize=3, label=e["name"])
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([i + width * (len(others) - 1) / 2 for i in range(len(cats))], cats, rotation=30, ha="right")
    save(fig, ax, "Speedup by category (bars: median; whiskers: p25-p75 over prompts)",
         "speedup over plain decoding", PLOTS[0])


def _accepted_length_histogram(plt, save, spec: list[dict]) -> None:
    """Share of drafting rounds that accepted n drafts, per configuration."""
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / max(1, len(spec))
    for j, e in enumerate(spec):
        counts = e["overall"].get("accepted_length_counts") or []
        total = sum(counts)
        if total:
            offset = (j - (len(spec) - 1) / 2) * width  # each group centred on its n
            ax.bar([n + offset for n in range(len(counts))], [c / total for c in counts], width, label=e["name"])
    ax.set_xlabel("drafts accepted in a round")
    ax.xaxis.get_major_locator().set_params(integer=True)
    save(fig, ax, "Accepted length per round", "share of rounds", PLOTS[1])


def _acceptance_by_position(plt, save, others: list[dict]) -> None:
    fig, ax = plt.subplots(figsize=(6, 4))
    for e in others:
        per_pos = e["overall"].get("acceptance_by_position") or []
        if per_pos:
            ax.plot(range(1, len(per_pos) + 1), per_pos, marker="o", label=e["name"])
    ax.set_xlabel("draft position")
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.set_ylim(0, 1.02)
    save(fig, ax, "Acceptance by draft position", "P(accepted | reached)", PLOTS[2])


def _tokens_over_time(plt, save, timeline: dict | None) -> None:
    """Tokens committed against time in one generation per configuration: the slope is tokens/s; a
    speculative round shows as a step of several tokens."""
    fig, ax = plt.subplots(figsize=(6, 4))
    title = "Tokens over time"
    if timeline:
        title += f" ({timeline['prompt_id']})"
        for name, points in timeline["configs"].items():
            xs, ys = [0.0] + [t for t, _ in points], [0] + [n for _, n in points]
            rate = ys[-1] / xs[-1] if xs[-1] > 0 else 0.0
            ax.step(xs, ys, where="post", label=f"{name} ({rate:.1f} tok/s)",
                    linestyle="--" if name == "plain" else "-")
    ax.set_xlabel("seconds since the generation started")
    save(fig, ax, title, "tokens generated", PLOTS[3])


def _speedup_vs_k(plt, save, spec: list[dict]) -> None:
    """Median speedup against the mean number of drafts per round, per drafter: fixed k joined by a line
    (with the Leviathan bound for the model drafter), k = auto a star at the mean k it chose."""
    fig, ax = plt.subplots(figsize=(6, 4))
    for drafter in dict.fromkeys(e["drafter"] for e in spec):
        mine = [e for e in spec if e["drafter"] == drafter and "speedup_median" in e["overall"]]
        fixed = sorted((e for e in mine if isinstance(e["k"], int)), key=lambda e: e["k"])
        color = None
        if fixed:
            line, = ax.plot([e["k"] for e in fixed], [e["overall"]["speedup_median"] for e in fixed], marker="o",
                            label=f"{drafter}, fixed k")
            color = line.get_color()
            bounded = [e for e in fixed if "bound" in e["overall"]]
            if drafter == "model" and bounded:
                ax.plot([e["k"] for e in bounded], [e["overall"]["bound"] for e in bounded], marker="x",
                        linestyle="--", label="Leviathan bound")
        for e in mine:
            if e["k"] == "auto":
                ax.plot([e["overall"].get("mean_k", 0.0)], [e["overall"]["speedup_median"]], marker="*",
                        markersize=14, linestyle="none", color=color, label=f"{drafter}, k=auto (at its mean k)")
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("drafts per round (k = auto: mean over its rounds, plain ones as 0)")
    ax.xaxis.get_major_locator().set_params(integer=True)
    save(fig, ax, "Speedup vs k", "speedup over plain decoding (median)", PLOTS[4])
