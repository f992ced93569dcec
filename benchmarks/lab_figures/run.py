"""The lab's figures for the issue's closing note: Llama-3.1-8B on one H100 and Llama-3.1-70B on 4x H100
(TP 4), ShareGPT-like workload, 1, 4 and 16 requests/s, priced as `servelab lab simulate` prices them by
default (the shipped calibration, engine vllm, one step per scheduling pass, mixed batches). Writes
benchmarks/lab_figures/lab_figures.{json,md}.

    .venv/bin/python benchmarks/lab_figures/run.py
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from servelab.lab.analysis.evaluate import evaluate
from servelab.lab.api import DeploymentRequest
from servelab.workload import WorkloadConfig, generate_workload

SHAPES = [("llama-3.1-8b", 1, 1), ("llama-3.1-70b", 4, 4)]
RATES = [1.0, 4.0, 16.0]
NUM_PROMPTS = 2000
KEYS = ["request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
        "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms"]


def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    rows = []
    for model, num_gpus, tp in SHAPES:
        d = DeploymentRequest(model=model, gpu="h100", num_gpus=num_gpus, tp=tp).build()
        for rate in RATES:
            w = generate_workload(WorkloadConfig(dataset="sharegpt-like", num_prompts=NUM_PROMPTS, request_rate=rate))
            e = evaluate(d, w)
            m = e.meters
            rows.append({"model": model, "gpus": f"{num_gpus}x H100 TP{tp}", "request_rate": rate,
                         **{k: e.metrics[k] for k in KEYS},
                         "kv_peak_usage": m["kv_cache"]["peak_usage"], "mean_running": m["batch_slots"]["mean_running"],
                         "decode_utilization": m["decode_throughput"]["utilization"],
                         "bottlenecks": [name for name, meter in m.items() if meter.get("bottleneck")]})
    out = Path(__file__).parent
    out.mkdir(parents=True, exist_ok=True)
    (out / "lab_figures.json").write_text(json.dumps({"num_prompts": NUM_PROMPTS, "seed": 0, "rows": rows}, indent=2) + "\n")
    head = ("| model | GPUs | req/s | out tok/s | TTFT p50 / p99 (ms) | TPOT p50 / p99 (ms) | E2E p50 (s) "
            "| mean batch | KV peak |")
    lines = [head, "|" + "---|" * 9]
    for r in rows:
        lines.append(f"| {r['model']} | {r['gpus']} | {r['request_rate']:g} | {r['output_throughput']:,.0f} | "
                     f"{r['median_ttft_ms']:.1f} / {r['p99_ttft_ms']:.1f} | {r['median_tpot_ms']:.1f} / "
                     f"{r['p99_tpot_ms']:.1f} | {r['median_e2el_ms'] / 1000:.2f} | {r['mean_running']:.1f} | "
                     f"{r['kv_peak_usage']:.0%} |")
    table = "\n".join(lines)
    (out / "lab_figures.md").write_text(f"# Lab figures (ShareGPT-like, {NUM_PROMPTS} requests, seed 0, "
                                        f"calibration public, engine vllm)\n\n"
                                        f"{table}\n\nCommand: `python benchmarks/lab_figures/run.py`\n")
    print(table)


if __name__ == "__main__":
    main()
