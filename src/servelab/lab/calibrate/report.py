"""A calibration's per-point results and their summary: measured, fitted (in-sample) and held-out
(leave-one-source-out) simulations, relative errors, by kind of measurement and by source."""
from __future__ import annotations

import math

from servelab.lab.calibrate.targets import Target
from servelab.specs import precision

WITHIN = 0.25  # a source's mean held-out error should stay within this
CROSS_VALIDATION = "leave-one-source-out"


def _error(simulated: float | None, value: float) -> float | None:
    return None if simulated is None else simulated / value - 1


def _mae(errors: list[float]) -> float:
    return sum(map(abs, errors)) / len(errors) if errors else math.nan


def _summary_by(points: list[dict], key: str) -> dict:
    out = {}
    for value in dict.fromkeys(p[key] for p in points):
        mine = [p for p in points if p[key] == value]
        out[value] = {"count": len(mine),
                      "held_out_mean_abs_error": _mae([p["held_out_error"] for p in mine if p["held_out_error"] is not None]),
                      "fitted_mean_abs_error": _mae([p["fitted_error"] for p in mine if p["fitted_error"] is not None])}
    return out


def fit_report(targets: list[Target], fitted: list[float | None], held_out: list[float | None],
               in_fit: list[bool] | None = None) -> dict:
    """in_fit False: a point of a source the fit never used, predicted by the full fit (its held-out value is
    that prediction); the leave-one-source-out headline is over the fitted sources' points."""
    points = []
    for n, (t, f, h) in enumerate(zip(targets, fitted, held_out)):
        points.append({"id": t.id, "group": t.group, "source": t.source, "gpu": t.gpu, "engine": t.engine,
                       "precision": precision(t.deployment.dtype, t.deployment.quantization), "tp": t.deployment.tp,
                       "load": t.load, "input_len": t.workload.input_len, "metric": t.metric,
                       "measured": t.value, "fitted": f, "fitted_error": _error(f, t.value),
                       "held_out": h, "held_out_error": _error(h, t.value),
                       "in_fit": True if in_fit is None else in_fit[n]})
    fitted_points = [p for p in points if p["in_fit"]]
    others = [p for p in points if not p["in_fit"]]
    held = [p["held_out_error"] for p in fitted_points if p["held_out_error"] is not None]
    by_source = _summary_by(fitted_points, "source")
    other_errors = [p["held_out_error"] for p in others if p["held_out_error"] is not None]
    summary = {"cross_validation": CROSS_VALIDATION, "num_sources": len(by_source), "num_points": len(fitted_points),
               "held_out_mean_abs_error": _mae(held), "held_out_max_abs_error": max(map(abs, held), default=math.nan),
               "num_sources_within_25pct": sum(v["held_out_mean_abs_error"] <= WITHIN for v in by_source.values()),
               "fitted_mean_abs_error": _mae([p["fitted_error"] for p in fitted_points if p["fitted_error"] is not None]),
               "by_group": _summary_by(fitted_points, "group"), "by_source": by_source}
    if others:
        summary["other_sources"] = {
            "num_points": len(others), "held_out_mean_abs_error": _mae(other_errors),
            "held_out_max_abs_error": max(map(abs, other_errors), default=math.nan),
            "by_source": _summary_by(others, "source")}
    return {"summary": summary, "points": points}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:,.2f}" if abs(x) < 1000 else f"{x:,.0f}")


def format_report(report: dict, values: dict[str, float]) -> str:
    s = report["summary"]
    lines = [f"{'point':<68} {'metric':<18} {'measured':>10} {'fitted':>10} {'held-out':>10} {'error':>8}"]
    for p in report["points"]:
        lines.append(f"{p['id'][:68]:<68} {p['metric']:<18} {_num(p['measured']):>10} {_num(p['fitted']):>10} "
                     f"{_num(p['held_out']):>10} {_pct(p['held_out_error']):>8}")
    lines.append("")
    lines.append(f"leave-one-source-out (held-out) mean |error| {s['held_out_mean_abs_error']:.1%}, "
                 f"max {s['held_out_max_abs_error']:.1%} over {s['num_points']} points of {s['num_sources']} sources "
                 f"({s['num_sources_within_25pct']} sources' means within 25%); in-sample {s['fitted_mean_abs_error']:.1%}")
    other = s.get("other_sources")
    if other:
        lines.append(f"sources the fit never used, predicted by it: mean |error| {other['held_out_mean_abs_error']:.1%}, "
                     f"max {other['held_out_max_abs_error']:.1%} over {other['num_points']} points")
    for title, group in (("by kind", s["by_group"]), ("by source", s["by_source"]),
                         ("other sources", (other or {}).get("by_source", {}))):
        lines.append(f" {title}:")
        for g, v in group.items():
            lines.append(f"  {g[-60:]:<60} {v['count']:>3} points  held-out {v['held_out_mean_abs_error']:.1%}  "
                         f"fitted {v['fitted_mean_abs_error']:.1%}")
    lines.append("")
    lines.append("constants:")
    lines += [f"  {k:<48} {v:.4g}" for k, v in sorted(values.items())]
    return "\n".join(lines)
