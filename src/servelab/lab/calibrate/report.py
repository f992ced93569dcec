"""A calibration's per-point results and their summary: measured, fitted (in-sample) and held-out
(cross-validated) simulations, relative errors, grouped by kind of measurement."""
from __future__ import annotations

import math

from servelab.lab.calibrate.targets import Target

WITHIN = 0.25  # the acceptance bound on every point's held-out error


def _error(simulated: float | None, value: float) -> float | None:
    return None if simulated is None else simulated / value - 1


def _mae(errors: list[float]) -> float:
    return sum(map(abs, errors)) / len(errors) if errors else math.nan


def fit_report(targets: list[Target], fitted: list[float | None], held_out: list[float | None], k: int) -> dict:
    points = []
    for t, f, h in zip(targets, fitted, held_out):
        points.append({"id": t.id, "group": t.group, "gpu": t.gpu, "engine": t.engine, "metric": t.metric,
                       "measured": t.value, "fitted": f, "fitted_error": _error(f, t.value),
                       "held_out": h, "held_out_error": _error(h, t.value), "excluded": t.excluded or None})
    used = [p for p in points if not p["excluded"]]
    held = [p["held_out_error"] for p in used if p["held_out_error"] is not None]
    by_group = {}
    for g in dict.fromkeys(p["group"] for p in used):
        e = [p["held_out_error"] for p in used if p["group"] == g and p["held_out_error"] is not None]
        by_group[g] = {"count": len(e), "held_out_mean_abs_error": _mae(e),
                       "fitted_mean_abs_error": _mae([p["fitted_error"] for p in used
                                                      if p["group"] == g and p["fitted_error"] is not None])}
    summary = {"folds": k, "num_points": len(points), "num_used": len(used), "num_excluded": len(points) - len(used),
               "held_out_mean_abs_error": _mae(held), "held_out_max_abs_error": max(map(abs, held), default=math.nan),
               "num_within_25pct": sum(abs(e) <= WITHIN for e in held) if held else 0,
               "fitted_mean_abs_error": _mae([p["fitted_error"] for p in used if p["fitted_error"] is not None]),
               "by_group": by_group}
    return {"summary": summary, "points": points}


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:+.1%}"


def _num(x: float | None) -> str:
    return "n/a" if x is None else (f"{x:,.2f}" if abs(x) < 1000 else f"{x:,.0f}")


def format_report(report: dict, values: dict[str, float]) -> str:
    s = report["summary"]
    lines = [f"{'point':<68} {'metric':<18} {'measured':>10} {'fitted':>10} {'held-out':>10} {'error':>8}"]
    for p in report["points"]:
        tail = f"  excluded: {p['excluded']}" if p["excluded"] else ""
        lines.append(f"{p['id'][:68]:<68} {p['metric']:<18} {_num(p['measured']):>10} {_num(p['fitted']):>10} "
                     f"{_num(p['held_out']):>10} {_pct(p['held_out_error']):>8}{tail}")
    lines.append("")
    lines.append(f"{s['folds']}-fold cross-validated (held-out) mean |error| {s['held_out_mean_abs_error']:.1%}, "
                 f"max {s['held_out_max_abs_error']:.1%}, {s['num_within_25pct']} of {s['num_used']} within 25%; "
                 f"in-sample {s['fitted_mean_abs_error']:.1%}")
    for g, v in s["by_group"].items():
        lines.append(f"  {g:<20} {v['count']:>3} points  held-out {v['held_out_mean_abs_error']:.1%}  "
                     f"fitted {v['fitted_mean_abs_error']:.1%}")
    lines.append("")
    lines.append("constants:")
    lines += [f"  {k:<48} {v:.4g}" for k, v in sorted(values.items())]
    return "\n".join(lines)
