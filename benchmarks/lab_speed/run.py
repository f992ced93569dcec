"""Speed of the lab simulator: wall time of whole `servelab lab simulate` commands (imports, workload,
simulation, metrics, JSON), best of N runs, written to benchmarks/lab_speed/lab_speed.json.

    .venv/bin/python benchmarks/lab_speed/run.py [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

COMMAND = [sys.executable, "-m", "servelab.lab.cli", "simulate", "--model", "llama-3.1-8b", "--gpu", "h100",
           "--dataset", "sharegpt-like", "--num-prompts", "10000", "--seed", "0", "--json"]
RATES = ["1", "4", "16", "inf"]


def timed(argv: list[str]) -> tuple[float, float, dict]:
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime, json.loads(out.stdout)


def simulate_only(rate: float) -> float:
    """Seconds inside simulate() alone (no imports, workload generation, metrics or JSON)."""
    from servelab.lab.catalog import get_device, get_model
    from servelab.lab.sim.deployment import Deployment
    from servelab.lab.sim.simulate import simulate
    from servelab.workload import WorkloadConfig, generate_workload

    w = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=10000, request_rate=rate))
    d = Deployment(get_model("llama-3.1-8b"), get_device("h100"), num_gpus=1)
    start = time.process_time()
    simulate(d, w)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("lab_speed.json"))
    args = parser.parse_args()
    load_at_start = os.getloadavg()
    rows = []
    for rate in RATES:
        argv = COMMAND + ["--request-rate", rate]
        runs = [timed(argv) for _ in range(args.repeats)]
        payload = runs[-1][2]
        rows.append({
            "request_rate": rate, "best_wall_s": min(r[0] for r in runs), "best_cpu_s": min(r[1] for r in runs),
            "simulate_only_cpu_s": min(simulate_only(float(rate)) for _ in range(args.repeats)),
            "walls_s": [round(r[0], 3) for r in runs],
            "simulated_steps": payload["meters"]["step_time"]["num_steps"],
            "simulated_duration_s": payload["metrics"]["duration"],
            "command": " ".join(["python"] + argv[1:]),
        })
        print(f"rate {rate:>4}: best {rows[-1]['best_wall_s']:.2f} s wall ({rows[-1]['best_cpu_s']:.2f} s CPU), "
              f"simulate() alone {rows[-1]['simulate_only_cpu_s']:.2f} s CPU, {rows[-1]['simulated_steps']:,} steps",
              flush=True)
    single = COMMAND[:-5] + ["--num-prompts", "1000", "--seed", "0", "--json", "--request-rate", "4"]
    multi_wall, _, multi = timed(single)
    step_wall, _, stepwise = timed(single + ["--single-step"])
    result = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "runs": rows,
        "single_step_comparison_1000_requests_rate_4": {
            "multi_step_wall_s": multi_wall, "single_step_wall_s": step_wall,
            "same_metrics": multi["metrics"] == stepwise["metrics"],
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"single-step check (1000 requests): {multi_wall:.2f} s vs {step_wall:.2f} s, "
          f"same metrics: {result['single_step_comparison_1000_requests_rate_4']['same_metrics']}")


if __name__ == "__main__":
    main()
