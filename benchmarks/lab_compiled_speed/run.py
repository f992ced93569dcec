"""The autoscaled day (benchmarks/lab_autoscale_speed/run.py) pure Python against the mypyc build, side by side:
runs alternate between the two in fresh processes, and the medians of simulate()'s CPU seconds are
compared. Written to benchmarks/lab_compiled_speed/lab_compiled_speed.json.

    make compiled   # once: python -m servelab.compiled.build
    .venv/bin/python benchmarks/lab_compiled_speed/run.py [--hours 24] [--repeats 3]

Each run's answer (replicas, GPU-hours, SLO attainment, p99s) must be the same in both; it fails otherwise.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).parent
SAME = ("num_requests", "replicas_min", "replicas_max", "num_instances_started", "gpu_hours", "slo_attainment",
        "p99_ttft_ms", "p99_tpot_ms")


def one_run(hours: float, pure: bool) -> dict:
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env["SERVELAB_COMPILED"] = "0" if pure else "1"
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp, "run.json")
        subprocess.run([sys.executable, str(HERE / "lab_autoscale_speed.py"), "--hours", f"{hours:g}", "--out", str(out)],
                       check=True, env=env, stdout=subprocess.DEVNULL)
        result = json.loads(out.read_text())
    if result["compiled"] == pure:
        raise RuntimeError("the compiled build is not in use: run `python -m servelab.compiled.build` first"
                           if not pure else "SERVELAB_COMPILED=0 did not turn the build off")
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hours", type=float, default=24)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "lab_compiled_speed.json")
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    runs: dict[str, list[dict]] = {"pure": [], "compiled": []}
    for _ in range(args.repeats):
        for mode in runs:
            runs[mode].append(one_run(args.hours, mode == "pure"))
    answers = {json.dumps({k: r[k] for k in SAME}) for mode in runs for r in runs[mode]}
    if len(answers) != 1:
        raise RuntimeError(f"pure and compiled runs disagree: {answers}")
    cpu = {mode: [r["simulate_autoscaled_cpu_s"] for r in rs] for mode, rs in runs.items()}
    median = {mode: statistics.median(v) for mode, v in cpu.items()}
    payload = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), "hours": args.hours, "repeats": args.repeats,
        "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg(),
        "simulate_cpu_s": cpu, "median_cpu_s": median, "speedup": median["pure"] / median["compiled"],
        "max_rss_mib": {mode: max(r["max_rss_mib"] for r in rs) for mode, rs in runs.items()},
        "answer": json.loads(answers.pop()), "target_s": 60.0,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
