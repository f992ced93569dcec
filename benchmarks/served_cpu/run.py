"""Where the served burst's CPU goes: CPU seconds per output token in each process (API server, engine
cores, load generator), for one or more source trees run alternately on the same workload.

    python benchmarks/served_cpu/run.py --src old=/path/to/main/src --src new=src --rounds 3 -- --quantization int8

Each round starts `servelab serve <flags>` from each tree in turn (PYTHONPATH=<tree>), waits for it, runs
`servelab bench serve` from the same tree (64 x 128 in / 64 out at once, ignore_eos), and reads utime + stime
of every process from /proc before and after the benchmark client ran (the engine cores are the server's
children). CPU seconds are robust to a busy machine in a way that tokens/s are not; both are printed. Linux only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS  # utime, stime


def children(pid: int) -> list[int]:
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        found += [int(c) for c in (task / "children").read_text().split()]
    return found


def engine_cores(server_pid: int) -> list[int]:
    """The server's spawned engine-core processes (not multiprocessing's resource tracker)."""
    pids = []
    for child in children(server_pid):
        cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            pids.append(child)
    return pids


def wait_ready(url: str, server: subprocess.Popen, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"the server exited with {server.returncode}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(1)
    raise RuntimeError("the server did not start")


CLI = [sys.executable, "-m", "servelab.entrypoints.cli"]


@contextlib.contextmanager
def serving(serve_flags: list[str], port: int, env: dict, stderr=subprocess.DEVNULL):
    """`servelab serve <flags>` on 127.0.0.1:port, ready; (process, url). Stopped with SIGINT on exit (killed
    after 60 s)."""
    server = subprocess.Popen([*CLI, "serve", *serve_flags, "--port", str(port), "--log-level", "warning"], env=env,
                              stdout=subprocess.DEVNULL, stderr=stderr)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, server)
        yield server, url
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()


def one_run(label: str, src: Path, serve_flags: list[str], port: int, num_prompts: int, out_dir: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(src)}
    with serving(serve_flags, port, env, open(out_dir / f"{label}-server.log", "w")) as (server, url):
        cores = engine_cores(server.pid)
        before = {"api": cpu_seconds(server.pid), "engine": sum(cpu_seconds(p) for p in cores)}
        result_file = out_dir / f"{label}.json"
        client = subprocess.Popen([*CLI, "bench", "serve", "--base-url", url, "--num-prompts", str(num_prompts),
                                   "--input-len", "128", "--output-len", "64", "--seed", "0", "--ignore-eos",
                                   "--disable-tqdm", "--result-dir", str(out_dir), "--name", label,
                                   "--result-file", str(result_file)], env=env, stdout=subprocess.PIPE, text=True)
        _, _, rusage = os.wait4(client.pid, 0)
        client_out = client.stdout.read()
        after = {"api": cpu_seconds(server.pid), "engine": sum(cpu_seconds(p) for p in cores)}
    result = json.loads(result_file.read_text())
    tokens = result["total_output_tokens"]
    row = {"label": label, "output_tok_s": round(result["output_throughput"], 1),
           "p99_ttft_ms": round(result["p99_ttft_ms"], 1), "output_tokens": tokens,
           "load": os.getloadavg()[0]}
    for name in ("api", "engine"):
        row[f"{name}_cpu_s"] = round(after[name] - before[name], 2)
        row[f"{name}_ms_per_token"] = round((after[name] - before[name]) / tokens * 1000, 3)
    client_s = rusage.ru_utime + rusage.ru_stime
    row["client_cpu_s"], row["client_ms_per_token"] = round(client_s, 2), round(client_s / tokens * 1000, 3)
    if result.get("failed"):
        row["failed"] = result["failed"]
    print(json.dumps(row), flush=True)
    if not re.search(r"Output token throughput", client_out):
        print(client_out, file=sys.stderr)
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--src", action="append", required=True, help="LABEL=PATH of a tree's src folder (repeat)")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--port", type=int, default=8191)
    p.add_argument("serve_flags", nargs="*", help="after --: flags for `servelab serve`")
    args = p.parse_args()
    trees = [(label, Path(path).resolve()) for label, _, path in (s.partition("=") for s in args.src)]
    out_dir = Path(tempfile.mkdtemp(prefix="served-cpu-"))
    for round_index in range(args.rounds):
        for label, src in trees:
            one_run(f"{label}{round_index}", src, args.serve_flags, args.port, args.num_prompts, out_dir)


if __name__ == "__main__":
    main()
