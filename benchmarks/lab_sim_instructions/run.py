"""Instructions simulate() executes on a fixed slice, counted by valgrind (cachegrind's I refs): a speed figure
that other jobs on a shared machine do not move (its run-to-run spread is about 1 %), for A/B-ing changes to
the simulator's hot path. Written to benchmarks/lab_sim_instructions/lab_sim_instructions.json (with the mypyc build
of `make compiled` in use under SERVELAB_COMPILED=1 or auto, which it records; by default pure Python).

    .venv/bin/python benchmarks/lab_sim_instructions/run.py [--src OTHER_TREE/src]

The slice: 4,887 sharegpt-llama3 requests at 12 req/s through 4 fixed Llama-3.1-8B replicas on H100s with
--max-num-seqs 8 (about 2.2 steps or runs per request, as in the autoscaled day). It counts a run of the
whole script and one that stops before simulate(), and reports the difference. --src times another source
tree (e.g. the main checkout's) with this one's interpreter.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

RATE_SCHEDULE = "ramp:0=12,400=12"


def inner(run: bool) -> None:
    from servelab import compiled
    from servelab.lab import api
    from servelab.lab.sim.simulate import simulate
    from servelab.workload import WorkloadConfig, generate_workload

    workload = generate_workload(WorkloadConfig(dataset="sharegpt-llama3", rate_schedule=RATE_SCHEDULE, seed=0))
    deployment = api.DeploymentRequest(model="llama-3.1-8b", gpu="h100", max_num_seqs=8, num_gpus=4).build()
    if run:
        result = simulate(deployment, workload)
        print(json.dumps({"num_requests": len(workload),
                          "num_entries": sum(len(i.step_stats) for i in result.instances),
                          "compiled": compiled.active()}))


def instructions(src: str | None, run: bool) -> tuple[int, str]:
    # one BLAS/OpenMP thread: numpy's idle worker threads otherwise add a varying count (5 % run to run)
    env = {**os.environ, "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    if src:
        env["PYTHONPATH"] = src
    out = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                          sys.executable, __file__, "--inner", "run" if run else "skip"],
                         capture_output=True, text=True, check=True, env=env)
    refs = re.search(r"I\s+refs:\s+([\d,]+)", out.stderr)
    return int(refs.group(1).replace(",", "")), out.stdout


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--inner", choices=["run", "skip"])
    parser.add_argument("--src", help="another source tree's src folder to count instead of this one's")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("lab_sim_instructions.json"))
    args = parser.parse_args()
    if args.inner:
        inner(args.inner == "run")
        return
    skip, _ = instructions(args.src, run=False)
    total, stdout = instructions(args.src, run=True)
    counts = json.loads(stdout)
    payload = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "rate_schedule": RATE_SCHEDULE, "replicas": 4,
               "max_num_seqs": 8, "src": args.src or "this checkout", **counts,
               "simulate_instructions": total - skip,
               "instructions_per_request": (total - skip) / counts["num_requests"]}
    if not args.src:
        args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
