"""The cost frontier as text (the cheapest configuration meeting the targets, then each frontier as a table) and
as a two-panel plot (PNG)."""
from __future__ import annotations

from pathlib import Path

from servelab.lab.analysis.frontier import Frontier, FrontierPoint

_HEADER = ("configuration", "GPUs", "$/h", "$/M tok", "tok/s/GPU", "TTFT p99", "TPOT p99", "SLO met")


def _row(p: FrontierPoint) -> tuple[str, ...]:
    m = p.evaluation.metrics
    return (p.label(), str(p.deployment.num_gpus), f"{p.usd_per_hour:,.2f}", f"{p.usd_per_million_tokens:,.3f}",
            f"{p.tokens_per_s_per_gpu:,.0f}", f"{m['p99_ttft_ms']:,.0f} ms", f"{m['p99_tpot_ms']:,.1f} ms",
            f"{p.slo_attainment:.0%}")


def format_table(points: list[FrontierPoint]) -> list[str]:
    rows = [_HEADER] + [_row(p) for p in points]
    widths = [max(len(r[i]) for r in rows) for i in range(len(_HEADER))]
    return ["  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths)))
            for r in rows]


def format_frontier(f: Frontier, all_points: bool = False) -> list[str]:
    lines = []
    if f.cheapest is None:
        lines.append(f"no configuration meets the targets ({f.num_simulated} simulated)")
    else:
        c = f.cheapest
        lines.append(f"cheapest meeting the targets: {c.label()}: {c.deployment.num_gpus} GPUs, "
                     f"${c.usd_per_hour:,.2f}/h, ${c.usd_per_million_tokens:,.3f} per million output tokens "
                     f"({c.price.provider or 'price'} ${c.price.usd_per_gpu_hour:g}/GPU-h"
                     + (f", {c.price.date}" if c.price.date else "") + ")")
        for metric, band in (c.fidelity_band or {}).items():
            lines.append(f"  {metric} error band {band['text']}")
    lines.append(f"throughput frontier (tokens/s per GPU vs {f.latency_metric}):")
    lines += format_table(f.throughput_frontier)
    lines.append("cost frontier ($ per million output tokens vs SLO attainment):")
    lines += format_table(f.cost_frontier)
    if all_points:
        lines.append(f"every configuration that fits ({len(f.points)} of {f.num_simulated} simulated):")
        lines += format_table(sorted(f.points, key=lambda p: p.usd_per_million_tokens))
    for gpu, why in f.skipped.items():
        lines.append(f"not searched: {gpu}: {why}")
    return lines


def plot_frontier(f: Frontier, path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    gpus = sorted({p.deployment.device.id for p in f.points})
    colors = {g: plt.get_cmap("tab10")(i) for i, g in enumerate(gpus)}
    for g in gpus:
        pts = [p for p in f.points if p.deployment.device.id == g]
        left.scatter([p.evaluation.metrics[f.latency_metric] for p in pts], [p.tokens_per_s_per_gpu for p in pts],
                     s=14, alpha=0.45, color=colors[g], label=g)
        right.scatter([p.slo_attainment * 100 for p in pts], [p.usd_per_million_tokens for p in pts], s=14,
                      alpha=0.45, color=colors[g], label=g)
    left.plot([p.evaluation.metrics[f.latency_metric] for p in f.throughput_frontier],
              [p.tokens_per_s_per_gpu for p in f.throughput_frontier], color="black", marker="o", lw=1.2)
    right.plot([p.slo_attainment * 100 for p in f.cost_frontier], [p.usd_per_million_tokens for p in f.cost_frontier],
               color="black", marker="o", lw=1.2)
    if f.cheapest is not None:
        right.scatter([f.cheapest.slo_attainment * 100], [f.cheapest.usd_per_million_tokens], marker="*", s=180,
                      color="gold", edgecolor="black", zorder=5, label="cheapest meeting targets")
    left.set_xscale("log")
    left.set_xlabel(f"{f.latency_metric} (log)")
    left.set_ylabel("output tokens/s per GPU")
    right.set_xlabel("SLO attainment (%)")
    right.set_ylabel("$ per million output tokens")
    right.set_yscale("log")
    for ax in (left, right):
        ax.grid(True, alpha=0.3)
    right.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
