"""The lab's error on published points it never saw, by regime: the leave-one-source-out errors that
`servelab lab calibrate --reference` stored in a calibration profile, tabled by precision, TP, load level,
context, engine and GPU family, by source, and the worst points.

    PYTHONPATH=src python benchmarks/reference_table/run.py [--calibration public] [--out DIR]

Writes reference.md and reference.json to benchmarks/reference_table/ (no simulation: the profile holds each
point's held-out and in-sample predictions).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from servelab.lab.catalog import get_device
from servelab.lab.catalog.calibration import DEFAULT_CALIBRATION, load_calibration

OUT_DIR = Path(__file__).parent
LONG_CONTEXT = 8192  # input tokens from which a point counts as long-context
REGIMES = {
    "precision": lambda p: p["precision"],
    "TP": lambda p: "TP1" if p["tp"] == 1 else "TP>1",
    "load": lambda p: p["load"] or "unknown",
    "context": lambda p: "long (>= 8k in)" if (p.get("input_len") or 0) >= LONG_CONTEXT else "short (< 8k in)",
    "engine": lambda p: p["engine"],
    "GPU family": lambda p: get_device(p["gpu"]).family,
    "source": lambda p: p["source"],
}


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def table(points: list[dict], regime: str) -> list[dict]:
    key = REGIMES[regime]
    rows = []
    for value in sorted({key(p) for p in points}):
        mine = [p for p in points if key(p) == value]
        held = [abs(p["held_out_error"]) for p in mine if p["held_out_error"] is not None]
        fitted = [abs(p["fitted_error"]) for p in mine if p["fitted_error"] is not None]
        rows.append({"value": value, "count": len(mine), "held_out_mean_abs_error": _mean(held),
                     "held_out_max_abs_error": max(held, default=None), "fitted_mean_abs_error": _mean(fitted)})
    return rows


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def render(name: str, summary: dict, tables: dict[str, list[dict]], worst: list[dict]) -> str:
    lines = [f"# Held-out error by regime (calibration `{name}`)", "",
             f"`PYTHONPATH=src python benchmarks/reference_table/run.py --calibration {name}`", "",
             f"Leave-one-source-out: each point predicted by a fit, from the priors, to the other sources' points. "
             f"**Mean |error| {_pct(summary['held_out_mean_abs_error'])}** over {summary['num_points']} points of "
             f"{summary['num_sources']} sources, largest {_pct(summary['held_out_max_abs_error'])}; in-sample "
             f"{_pct(summary['fitted_mean_abs_error'])}.", ""]
    for regime, rows in tables.items():
        lines += [f"## By {regime}", "", f"| {regime} | points | held-out mean | held-out max | in-sample mean |",
                  "|---|---|---|---|---|"]
        lines += [f"| {r['value']} | {r['count']} | {_pct(r['held_out_mean_abs_error'])} | "
                  f"{_pct(r['held_out_max_abs_error'])} | {_pct(r['fitted_mean_abs_error'])} |" for r in rows]
        lines.append("")
    lines += ["## Worst points (held out)", "", "| point | metric | measured | held-out | error |", "|---|---|---|---|---|"]
    lines += [f"| {p['id']} | {p['metric']} | {p['measured']:,.2f} | {p['held_out']:,.2f} | {p['held_out_error']:+.1%} |"
              for p in worst]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calibration", default=DEFAULT_CALIBRATION)
    parser.add_argument("--out", type=Path, default=OUT_DIR)
    args = parser.parse_args()
    profile = load_calibration(args.calibration)
    points, summary = profile.fit["points"], profile.fit["summary"]
    tables = {regime: table(points, regime) for regime in REGIMES}
    held = [p for p in points if p["held_out_error"] is not None]
    worst = sorted(held, key=lambda p: -abs(p["held_out_error"]))[:10]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "reference.json").write_text(json.dumps({"summary": summary, "tables": tables}, indent=1) + "\n")
    (args.out / "reference.md").write_text(render(args.calibration, summary, tables, worst))
    print(render(args.calibration, summary, tables, worst))


if __name__ == "__main__":
    main()
