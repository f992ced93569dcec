"""The long schema-fuzzing run: schemathesis against a real gateway process (stub engine, an API key) from
the OpenAPI schema it publishes (servelab/testing/fuzz.py), then a check that it still serves. Writes
benchmarks/fuzz/fuzz.json and fuzz.md.

    flock /work/bench.lock timeout 900 .venv/bin/python benchmarks/fuzz/run.py [--examples-per-mode 500]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx

from servelab.testing.fuzz import run_fuzz
from servelab.testing.stub_server import StubServerProcess

HERE = Path(__file__).parent

API_KEY = "fuzz-key"
SERVER_FLAGS = ("--api-key", API_KEY, "--stub-max-model-len", "256", "--stub-num-blocks", "512",
                "--max-num-queued-requests", "10000", "--max-queued-tokens", "100000000", "--log-level", "warning")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples-per-mode", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    log_path = args.out / "fuzz-server.log.tmp"
    server = StubServerProcess(SERVER_FLAGS, log_path).wait_ready(timeout=60)
    try:
        load_before = os.getloadavg()
        start = time.perf_counter()
        report = run_fuzz(server.url, API_KEY, args.examples_per_mode, seed=args.seed)
        wall = time.perf_counter() - start
        after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                           headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
        still_serving = after.status_code == 200 and after.json()["choices"][0]["text"] == " w1 w2 w3"
        load_after = os.getloadavg()
        server_errors = [line for line in server.log().splitlines() if "Traceback" in line or "ERROR" in line]
    finally:
        server.stop()
        log_path.unlink(missing_ok=True)
    result = {"command": " ".join(["benchmarks/fuzz/run.py", *sys.argv[1:]]),
              "server": "python -m servelab.testing.stub_server " + " ".join(SERVER_FLAGS),
              "schemathesis": __import__("schemathesis").__version__ if hasattr(__import__("schemathesis"),
                                                                               "__version__") else None,
              "examples_per_mode": args.examples_per_mode, "seed": args.seed, "num_cases": report.num_cases,
              "statuses": {str(k): v for k, v in sorted(report.statuses.items())}, "num_5xx": report.num_5xx,
              "num_failures": len(report.failures), "failures": report.failures[:50],
              "server_error_lines": len(server_errors), "still_serving": still_serving, "wall_s": round(wall, 1),
              "load_average": {"before": [round(x, 2) for x in load_before],
                               "after": [round(x, 2) for x in load_after]},
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    result["passed"] = (not report.failures and report.num_5xx == 0 and still_serving and not server_errors)
    (args.out / "fuzz.json").write_text(json.dumps(result, indent=2) + "\n")
    md = (f"# Schema fuzzing ({result['date']})\n\n`{result['command']}` against `{result['server']}`\n\n"
          f"| | |\n| --- | --- |\n| cases | {result['num_cases']} |\n"
          f"| statuses | {', '.join(f'{k}: {v}' for k, v in result['statuses'].items())} |\n"
          f"| 5xx | {result['num_5xx']} |\n| check failures | {result['num_failures']} |\n"
          f"| server error lines in its log | {result['server_error_lines']} |\n"
          f"| still serving afterwards | {still_serving} |\n| wall time | {result['wall_s']} s |\n"
          f"| load average before / after | {result['load_average']['before'][0]} / "
          f"{result['load_average']['after'][0]} |\n| passed | {result['passed']} |\n")
    (args.out / "fuzz.md").write_text(md)
    print(md)
    return 0 if result["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
