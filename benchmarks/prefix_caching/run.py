"""TTFT with and without prefix caching on a shared 1,000-token prefix, through `servelab bench serve` against
the real server (default model), written to benchmarks/prefix_caching/prefix-caching-{on,off}/ and
benchmarks/prefix_caching/prefix_caching.{json,md}. Heavy: run it under the bench lock.

    flock /work/bench.lock timeout 900 .venv/bin/python benchmarks/prefix_caching/run.py

One request at a time (--max-concurrency 1), so TTFT is the prefill alone, not queueing. bench serve's probe
request (the first prompt, 4 tokens) runs first, so with caching every measured request finds the prefix
cached, as in a server that has seen it before.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from servelab.bench.stages import ServelabServer

RESULTS = Path(__file__).parent
COUNTER = re.compile(r"^servelab:(prefix_cache_(?:queries|hits)_total)\{[^}]*\} (\S+)$", re.MULTILINE)


def bench_args(num_prompts: int, prefix_len: int, suffix_len: int, output_len: int) -> list[str]:
    return ["--dataset", "prefix-shared", "--num-prefixes", "1", "--prefix-len", str(prefix_len),
            "--input-len", str(suffix_len), "--output-len", str(output_len), "--num-prompts", str(num_prompts),
            "--max-concurrency", "1", "--ignore-eos", "--seed", "0", "--disable-tqdm"]


def run_mode(caching: bool, server_flags: list[str], workload: list[str], startup_timeout_s: float) -> dict:
    import httpx

    name = f"prefix-caching-{'on' if caching else 'off'}"
    flags = [*server_flags, "--enable-prefix-caching" if caching else "--no-enable-prefix-caching"]
    with tempfile.TemporaryDirectory() as tmp, \
            ServelabServer(None, flags, Path(tmp) / "server.log", startup_timeout_s) as server:
        subprocess.run([sys.executable, "-m", "servelab.entrypoints.cli", "bench", "serve", "--base-url", server.url,
                        *workload, "--name", name, "--result-dir", str(RESULTS)], check=True)
        counters = {k: int(float(v)) for k, v in COUNTER.findall(httpx.get(f"{server.url}/metrics", timeout=10).text)}
    result = json.loads((RESULTS / name / f"{name}.json").read_text())
    return {"server_flags": flags, "median_ttft_ms": result["median_ttft_ms"], "mean_ttft_ms": result["mean_ttft_ms"],
            "p99_ttft_ms": result["p99_ttft_ms"], "median_tpot_ms": result.get("median_tpot_ms"), **counters}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--prefix-len", type=int, default=1000)
    p.add_argument("--suffix-len", type=int, default=24)
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--server-args", default="", help="more `servelab serve` flags for both runs")
    p.add_argument("--server-timeout", type=float, default=600.0)
    args = p.parse_args()
    workload = bench_args(args.num_prompts, args.prefix_len, args.suffix_len, args.output_len)
    runs = {mode: run_mode(mode == "on", args.server_args.split(), workload, args.server_timeout)
            for mode in ("off", "on")}
    ratio = runs["off"]["median_ttft_ms"] / runs["on"]["median_ttft_ms"]
    summary = {"workload": workload, "runs": runs, "median_ttft_speedup": ratio,
               "load_average": os.getloadavg(), "machine": platform.processor() or platform.machine(),
               "cpus": os.cpu_count()}
    (RESULTS / "prefix_caching.json").write_text(json.dumps(summary, indent=2) + "\n")
    lines = ["# Prefix caching: TTFT on a shared prefix", "",
             f"`servelab bench serve {' '.join(workload)}` against `servelab serve` (default model), "
             f"load average {summary['load_average'][0]:.1f} on {summary['cpus']} CPUs.", "",
             "| prefix caching | TTFT median | mean | p99 | prefix-cache hits / queries (tokens) |", "|---|---|---|---|---|"]
    for mode, r in runs.items():
        lines.append(f"| {mode} | {r['median_ttft_ms']:.0f} ms | {r['mean_ttft_ms']:.0f} ms | {r['p99_ttft_ms']:.0f} ms "
                     f"| {r.get('prefix_cache_hits_total', 0):,} / {r.get('prefix_cache_queries_total', 0):,} |")
    lines += ["", f"Median TTFT {ratio:.1f}x lower with prefix caching."]
    (RESULTS / "prefix_caching.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
