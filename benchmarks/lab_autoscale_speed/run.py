"""Speed of an autoscaled day: a 24-hour diurnal trace averaging 10 req/s (~860,000 requests) through
Llama-3.1-8B on H100s under the KEDA/HPA policy, written to benchmarks/lab_autoscale_speed/lab_autoscale_speed.json.

    .venv/bin/python benchmarks/lab_autoscale_speed/run.py [--hours 24]

It times simulate() alone (the autoscaled run; wall and CPU seconds, CPU being what a busy shared machine
distorts least) and reports the replicas the autoscaler chose, the GPU-hours and
the SLO attainment; with --whole also the whole `lab simulate --autoscale ... --json` answer (the autoscaled
run again, the fixed peak-sized run it is compared with, metrics, meters, timeline and SLO-miss attribution). --hours shortens the day for a quick look (the
curve is the same 24-hour sine, cut short).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import time
from pathlib import Path

from servelab import compiled
from servelab.lab import api
from servelab.lab.analysis.autoscale_policies import AutoscalePolicyConfig, make_autoscaler
from servelab.lab.analysis.meters import request_timings
from servelab.lab.sim.scaling import ScalingConfig
from servelab.metrics.request_stats import compute_metrics
from servelab.lab.sim.simulate import simulate
from servelab.workload import WorkloadConfig, generate_workload

TARGETS = api.TargetsRequest(ttft_target_ms=500, tpot_target_ms=20)
AUTOSCALE = api.AutoscaleRequest(policy="keda", min_replicas=1, max_replicas=8, startup_s=120, cooldown_s=300,
                                 interval_s=30)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hours", type=float, default=24)
    parser.add_argument("--whole", action="store_true", help="also time the whole JSON answer")
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("lab_autoscale_speed.json"))
    args = parser.parse_args()
    schedule = f"diurnal:mean=10,peak=18,hours={args.hours:g}"
    workload_config = WorkloadConfig(dataset="sharegpt-llama3", rate_schedule=schedule, seed=0)
    # small batches (a latency-tuned replica) so that the day needs several replicas at its peak
    deployment_request = api.DeploymentRequest(model="llama-3.1-8b", gpu="h100", max_num_seqs=8)
    load_at_start = os.getloadavg()

    start = time.perf_counter()
    workload = generate_workload(workload_config)
    workload_s = time.perf_counter() - start
    policy = AutoscalePolicyConfig(policy="keda", interval_s=AUTOSCALE.interval_s, cooldown_s=AUTOSCALE.cooldown_s,
                                   ttft_target_s=TARGETS.ttft_target_ms / 1000,
                                   tpot_target_s=TARGETS.tpot_target_ms / 1000)
    scaling = ScalingConfig(AUTOSCALE.min_replicas, AUTOSCALE.max_replicas, AUTOSCALE.startup_s)
    start, cpu_start = time.perf_counter(), time.process_time()
    result = simulate(deployment_request.build(), workload, autoscaler=make_autoscaler(policy), scaling=scaling)
    simulate_s, simulate_cpu_s = time.perf_counter() - start, time.process_time() - cpu_start
    ready = [s.num_ready for s in result.scale_samples]
    timings = request_timings(result)
    metrics = compute_metrics(timings, result.duration, {"ttft": TARGETS.ttft_target_ms, "tpot": TARGETS.tpot_target_ms})
    whole = {}
    if args.whole:
        start = time.perf_counter()
        answer = api.simulate(api.SimulateRequest(deployment_request, workload_config, TARGETS, autoscale=AUTOSCALE,
                                                  slo_attribution=True)).to_json()
        a = answer["autoscaling"]
        whole = {"whole_answer_s": time.perf_counter() - start, "autoscaled": a["autoscaled"], "fixed": a["fixed"],
                 "gpu_hours_saved_share": a["gpu_hours_saved_share"], "slo_misses_share": answer["slo_misses"]["share"]}
    payload = {
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform(),
                    "load_average_at_start": load_at_start, "load_average_at_end": os.getloadavg()},
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "compiled": compiled.active(),  # the mypyc build of the simulator (servelab/compiled), or pure Python
        "command": f"lab simulate --model llama-3.1-8b --gpu h100 --max-num-seqs 8 --dataset sharegpt-llama3 --rate-schedule {schedule} "
                   "--autoscale keda --max-replicas 8 --startup-time 120 --cooldown 300 --scale-interval 30 "
                   "--ttft-target 500ms --tpot-target 20ms --slo-attribution --json",
        "num_requests": len(workload), "simulated_hours": result.duration / 3600,
        "workload_s": workload_s, "simulate_autoscaled_s": simulate_s, "simulate_autoscaled_cpu_s": simulate_cpu_s,
        "target_s": 60.0,
        "replicas_min": min(ready), "replicas_max": max(ready), "num_instances_started": len(result.instances),
        "gpu_hours": result.gpu_seconds() / 3600, "slo_attainment": metrics["slo_attainment"],
        "p99_ttft_ms": metrics["p99_ttft_ms"], "p99_tpot_ms": metrics["p99_tpot_ms"], **whole,
        "max_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    args.out.write_text(json.dumps(payload, indent=2) + "\n")
    print(json.dumps(payload, indent=2))


if __name__ == "__main__":
    main()
