"""How the engine core's idle OpenMP threads should wait under `servelab serve`: each variant's environment is set
for the server (the engine cores inherit it), rounds alternate the variants, and each server takes a 64-request
burst (128 in / 64 out at once) and then one stream at a time (6 requests, --max-concurrency 1) from
`servelab bench serve`. Writes benchmarks/openmp_wait/openmp_wait.json (every run, and the median per variant).

    python benchmarks/openmp_wait/run.py [--rounds 3] [-- serve flags, default --quantization int8 --kv-cache-dtype int8]

Variants: `passive` (OMP_WAIT_POLICY=PASSIVE, serve's setting before), `spin` (GOMP_SPINCOUNT=10000, ~0.1 ms,
serve's setting now) and `default` (GOMP_SPINCOUNT=300000, libgomp's own default, ~3 ms).
"""
from __future__ import annotations

import argparse
import json
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# the served-CPU benchmark's server start and CLI (benchmarks/served_cpu/run.py)
_spec = importlib.util.spec_from_file_location("served_cpu", Path(__file__).parents[1] / "served_cpu" / "run.py")
served_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(served_cpu)
CLI, serving = served_cpu.CLI, served_cpu.serving

VARIANTS = {"passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "spin": {"GOMP_SPINCOUNT": "10000"},
            "default": {"GOMP_SPINCOUNT": "300000"}}
KINDS = {"burst": ["--num-prompts", "64", "--input-len", "128", "--output-len", "64"],
         "single": ["--num-prompts", "6", "--input-len", "128", "--output-len", "64", "--max-concurrency", "1"]}
def one_server(env_extra: dict, flags: list[str], port: int, out: Path, label: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} | env_extra
    result = {}
    with serving(flags, port, env) as (_, url):
        for kind, args in KINDS.items():
            path = out / f"{label}-{kind}.json"
            subprocess.run([*CLI, "bench", "serve", "--base-url", url, *args, "--seed", "0", "--ignore-eos",
                            "--disable-tqdm", "--result-dir", str(out), "--name", f"{label}-{kind}", "--result-file",
                            str(path)], env=env, stdout=subprocess.DEVNULL, check=True)
            r = json.loads(path.read_text())
            result[kind] = {"output_tok_s": r["output_throughput"], "median_tpot_ms": r["median_tpot_ms"],
                            "p99_ttft_ms": r["p99_ttft_ms"]}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("openmp_wait.json"))
    parser.add_argument("flags", nargs="*", default=["--quantization", "int8", "--kv-cache-dtype", "int8"])
    args = parser.parse_args()
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for name, env in VARIANTS.items():
                result = one_server(env, args.flags, 18200 + r, Path(tmp), f"{name}-{r}")
                runs.append({"round": r, "variant": name, "env": env, "load": os.getloadavg()[0], **result})
                print(json.dumps(runs[-1]), flush=True)
    medians = {name: {kind: {k: statistics.median(run[kind][k] for run in runs if run["variant"] == name)
                             for k in ("output_tok_s", "median_tpot_ms", "p99_ttft_ms")} for kind in KINDS}
               for name in VARIANTS}
    for name, m in medians.items():
        print(f"{name:8s} burst {m['burst']['output_tok_s']:.1f} tok/s, one stream {m['single']['output_tok_s']:.1f} "
              f"tok/s (TPOT {m['single']['median_tpot_ms']:.1f} ms)")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "serve_flags": args.flags,
                                    "command": "python benchmarks/openmp_wait/run.py " + " ".join(sys.argv[1:]),
                                    "medians": medians, "runs": runs}, indent=2) + "\n")


if __name__ == "__main__":
    main()
