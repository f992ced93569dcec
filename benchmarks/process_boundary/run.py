"""The served burst across the API/engine-core process boundary, before and after a change, side by side.

    python benchmarks/process_boundary/run.py --old 2bc126e --new HEAD --rounds 3

Each source tree is `git archive`d from its revision into a temporary folder, then each round serves the
default model from the old tree and from the new one in turn (`servelab serve`, one engine core in its own
process), and sends the same burst at once with `servelab bench serve`: 64 requests x 128 prompt tokens x 64
output tokens, ignore_eos (benchmarks/served_cpu/run.py's one_run). It records the burst's output tokens/s and
the CPU seconds per output token of the API server process, the engine core and the load generator, read
from /proc around the burst. The medians and spreads (min-max) over the rounds go to result.json beside this
file (with every run) and to stdout as a markdown table. Linux only; run it under the machine's heavy lock.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
# the served-CPU benchmark's run of one tree (benchmarks/served_cpu/run.py)
_spec = importlib.util.spec_from_file_location("served_cpu", ROOT / "benchmarks" / "served_cpu" / "run.py")
served_cpu = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(served_cpu)
one_run = served_cpu.one_run

METRICS = ("output_tok_s", "api_ms_per_token", "engine_ms_per_token", "client_ms_per_token", "p99_ttft_ms")


def archive_src(revision: str, dest: Path) -> tuple[str, Path]:
    """(the full commit id, the src folder of `revision` unpacked under dest)."""
    commit = subprocess.run(["git", "rev-parse", revision], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    tar_path = dest / f"{commit}.tar"
    subprocess.run(["git", "archive", "--format=tar", "-o", str(tar_path), commit, "src"], cwd=ROOT, check=True)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest / commit, filter="data")
    return commit, dest / commit / "src"


def summary(rows: list[dict]) -> dict:
    return {m: {"median": round(statistics.median(r[m] for r in rows), 3),
                "min": round(min(r[m] for r in rows), 3), "max": round(max(r[m] for r in rows), 3)}
            for m in METRICS}


def table(result: dict) -> str:
    lines = ["| metric | old: median (min-max) | new: median (min-max) |", "| --- | --- | --- |"]
    old, new = result["old"]["summary"], result["new"]["summary"]
    for m in METRICS:
        cell = [f"{s[m]['median']:g} ({s[m]['min']:g}-{s[m]['max']:g})" for s in (old, new)]
        lines.append(f"| {m} | {cell[0]} | {cell[1]} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--old", required=True, help="git revision before the change")
    p.add_argument("--new", default="HEAD", help="git revision after it")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--port", type=int, default=8193)
    p.add_argument("--out", type=Path, default=HERE / "result.json")
    p.add_argument("serve_flags", nargs="*", help="after --: flags for `servelab serve`")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="process-boundary-"))
    trees = {side: archive_src(rev, work) for side, rev in (("old", args.old), ("new", args.new))}
    runs: dict[str, list[dict]] = {"old": [], "new": []}
    for round_index in range(args.rounds):
        for side, (_, src) in trees.items():
            runs[side].append(one_run(f"{side}{round_index}", src, args.serve_flags, args.port, args.num_prompts,
                                      work))
        result = {"command": " ".join([Path(sys.argv[0]).as_posix(), *sys.argv[1:]]),
                  "workload": f"{args.num_prompts} requests at once, 128 prompt tokens, 64 output tokens, ignore_eos",
                  "serve_flags": args.serve_flags, "cpu_count": len(os.sched_getaffinity(0)),
                  "rounds_done": round_index + 1,
                  **{side: {"commit": trees[side][0], "summary": summary(runs[side]), "runs": runs[side]}
                     for side in trees}}
        args.out.write_text(json.dumps(result, indent=1) + "\n")  # after every round: a cut-short run keeps them
    print(table(result))


if __name__ == "__main__":
    main()
