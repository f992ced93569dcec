"""The cost frontier of Llama 3.1 70B over H100, H200, A100 80GB and MI300X: `servelab lab advise --pareto` on a
chat-like workload (1024-token prompts, 256-token answers, 4 req/s) with p99 TTFT <= 1 s and p99 TPOT <= 60 ms,
priced with the shipped on-demand prices (lab/catalog/data/prices.json) and with AWS/Azure list prices
(prices-hyperscalers.json). Writes result-<prices>.json, result-<prices>.txt and frontier-<prices>.png here.

    python benchmarks/cost_frontier/run.py
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
DATA = Path(__file__).parents[2] / "src" / "servelab" / "lab" / "catalog" / "data"
ARGS = ["lab", "advise", "--pareto", "--model", "llama-3.1-70b", "--gpus", "h100,h200,a100-80gb,mi300x",
        "--num-prompts", "200", "--request-rate", "4", "--input-len", "1024", "--output-len", "256",
        "--ttft-target", "1s", "--tpot-target", "60ms", "--frontier-max-gpus", "8"]


def main() -> int:
    for name, prices in (("neocloud", DATA / "prices.json"), ("hyperscalers", DATA / "prices-hyperscalers.json")):
        base = [sys.executable, "-m", "servelab.entrypoints.cli", *ARGS, "--prices", str(prices)]
        plot = os.path.relpath(HERE / f"frontier-{name}.png")
        text = subprocess.run([*base, "--plot", plot], check=True, text=True,
                              stdout=subprocess.PIPE).stdout
        (HERE / f"result-{name}.txt").write_text(text)
        print(text)
        json_text = subprocess.run([*base, "--json"], check=True, text=True, stdout=subprocess.PIPE).stdout
        (HERE / f"result-{name}.json").write_text(json_text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
