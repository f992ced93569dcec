"""`lab sweep`: one meter or metric against one workload or deployment input, as a table and a PNG."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from servelab.lab.sim.deployment import Deployment
from servelab.lab.analysis.evaluate import Evaluation, Targets, evaluate
from servelab.workload import WorkloadConfig, generate_workload
from servelab.errors import FieldError

# flag name -> (which config, field, type)
SWEEPABLE = {
    "request-rate": ("workload", "request_rate", float),
    "input-len": ("workload", "input_len", int),
    "output-len": ("workload", "output_len", int),
    "burstiness": ("workload", "burstiness", float),
    "num-gpus": ("deployment", "num_gpus", int),
    "tp": ("deployment", "tensor_parallel_size", int),
    "max-num-seqs": ("deployment", "max_num_seqs", int),
    "max-num-batched-tokens": ("deployment", "max_num_batched_tokens", int),
}


def read_meter(e: Evaluation, name: str) -> float | None:
    """A metric key (p99_ttft_ms, output_throughput, ...) or meter.field (kv_cache.peak_usage, ...)."""
    if not e.fits:
        return None
    if "." in name:
        meter, field = name.split(".", 1)
        value = e.meters.get(meter, {}).get(field)
    else:
        value = e.metrics.get(name)
    if value is None or isinstance(value, (list, dict, bool)):
        raise FieldError(f"{{meter}} {name!r} is not a number the lab reports; try p99_ttft_ms, output_throughput, "
                         "kv_cache.peak_usage or batch_slots.mean_saturation", "meter")
    return float(value)


def parse_values(vary: str, text: str) -> list:
    if vary not in SWEEPABLE:
        raise FieldError(f"{{vary}} must be one of {', '.join(SWEEPABLE)}", "vary")
    kind = SWEEPABLE[vary][2]
    try:
        values = [kind(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise FieldError(f"{{values}} must be a comma-separated list of {kind.__name__}s, got {text!r}", "values") from None
    if not values:
        raise FieldError("{values} is empty", "values")
    return values


def run_sweep(deployment: Deployment, workload: WorkloadConfig, targets: Targets, vary: str, values: list,
              meter: str) -> list[dict]:
    where, field, _ = SWEEPABLE[vary]
    points = []
    for value in values:
        d, w = deployment, workload
        if where == "workload":
            w = replace(workload, **{field: value})
        else:
            d = replace(deployment, **{field: value})
        e = evaluate(d, generate_workload(w), targets)
        points.append({vary: value, meter: read_meter(e, meter), "fits": e.fits,
                       "meets_targets": e.meets_targets})
    return points


def plot_sweep(points: list[dict], vary: str, meter: str, path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [p[vary] for p in points if p[meter] is not None]
    ys = [p[meter] for p in points if p[meter] is not None]
    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    ax.plot(xs, ys, marker="o")
    ax.set_xlabel(vary)
    ax.set_ylabel(meter)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
