"""The soak benchmark: 10,000 requests through a real gateway process at saturation (servelab/testing/
soak.py: streaming and not, n > 1, stop strings, logprobs, clients leaving before the first token,
mid-stream and during a long prefill, requests running past --request-timeout, injected step faults), then
the books: one terminal outcome per request on both sides, nothing running or waiting, every KV block free,
anonymous RSS growth after warm-up. Writes benchmarks/soak/soak.json and soak.md.

The server is the stub engine behind the real gateway (servelab/testing/stub_server.py): what is soaked is the
gateway and the engine's bookkeeping (scheduler, block manager, aborts, timeouts, faults), at a request rate
the real model cannot reach on a CPU (10,000 requests of the 135M model would take hours on two cores).

    flock /work/bench.lock timeout 900 .venv/bin/python benchmarks/soak/run.py [--num-requests 10000]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

from servelab.testing.server import metric_values, wait_for_metrics
from servelab.testing.soak import check_request_log, rss_bytes, run_soak
from servelab.testing.stub_server import StubServerProcess

HERE = Path(__file__).parent

SERVER_FLAGS = ("--stub-num-blocks", "1024", "--stub-max-num-seqs", "32", "--stub-fail-word", "hello",
                "--request-timeout", "2", "--stub-step-delay", "0.002", "--log-level", "info")
RSS_GROWTH_BOUND_MIB = 16


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "soak-server.log.tmp"
    server = StubServerProcess(SERVER_FLAGS, log_path).wait_ready(timeout=60)
    rss_samples: list[tuple[int, int]] = []

    def sample(done: int) -> None:
        if done % max(1, args.num_requests // 10) == 0:
            rss_samples.append((done, rss_bytes(server.proc.pid), rss_bytes(server.proc.pid, "RssAnon")))

    try:
        load_before = os.getloadavg()
        report = asyncio.run(run_soak(server.url, args.num_requests, args.concurrency, args.seed, on_progress=sample))
        rss_end, anon_end = rss_bytes(server.proc.pid), rss_bytes(server.proc.pid, "RssAnon")
        values = wait_for_metrics(server.url, lambda v: v["servelab:num_requests_running"] == 0
                                  and v["servelab:num_requests_waiting"] == 0, timeout=60)
        values = metric_values(server.url)
        books = check_request_log(server.request_log_lines(), report)
        health = json.loads(__import__("httpx").get(f"{server.url}/health", timeout=10).text)
        load_after = os.getloadavg()
    finally:
        server.stop()
        log_path.unlink(missing_ok=True)
    warm, anon_warm = next((rss, anon) for done, rss, anon in rss_samples if done >= args.num_requests // 10)
    num_blocks = values["servelab:kv_cache_num_blocks"]
    result = {
        "command": " ".join(["benchmarks/soak/run.py", *sys.argv[1:]]), "server": "python -m servelab.testing.stub_server " +
        " ".join(SERVER_FLAGS), "num_requests": args.num_requests, "concurrency": args.concurrency,
        "seed": args.seed, "wall_s": round(report.wall_s, 1),
        "requests_per_s": round(args.num_requests / report.wall_s, 1),
        "planned": dict(report.planned), "outcomes": dict(sorted(report.outcomes.items())),
        "num_lost": len(report.lost), "lost": report.lost[:20],
        "num_disconnects": sum(v for k, v in report.outcomes.items() if k.startswith("left:")),
        "num_timeouts": report.outcomes.get("504:request_timeout", 0),
        "num_faults_injected": health["num_failed_steps"],
        "num_requests_failed_by_faults": report.outcomes.get("500:engine_step_failed", 0),
        "num_5xx_undocumented": sum(v for k, v in report.outcomes.items() if k.startswith("5")
                                    and k not in ("500:engine_step_failed", "503:slow_reader",
                                                  "504:request_timeout")),
        "request_log": books,
        "after": {"num_requests_running": values["servelab:num_requests_running"],
                  "num_requests_waiting": values["servelab:num_requests_waiting"],
                  "kv_cache_usage_perc": values["servelab:kv_cache_usage_perc"],
                  "kv_blocks_leaked": num_blocks - values["servelab:kv_cache_num_free_blocks"]},
        # bounded: anonymous RSS (VmRSS less file-backed pages, which other jobs' memory pressure moves)
        "anon_rss_mib": {"after_warmup": round(anon_warm / 2**20, 1), "end": round(anon_end / 2**20, 1),
                         "growth": round((anon_end - anon_warm) / 2**20, 1), "bound": RSS_GROWTH_BOUND_MIB},
        "rss_mib": {"after_warmup": round(warm / 2**20, 1), "end": round(rss_end / 2**20, 1),
                    "growth": round((rss_end - warm) / 2**20, 1),
                    "samples": [(done, round(rss / 2**20, 1), round(anon / 2**20, 1))
                                for done, rss, anon in rss_samples]},
        "load_average": {"before": [round(x, 2) for x in load_before], "after": [round(x, 2) for x in load_after]},
        "machine": {"cpu_count": os.cpu_count(), "python": platform.python_version()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    ok = (result["num_lost"] == 0 and result["num_5xx_undocumented"] == 0 and books["num_logged_twice"] == 0
          and books["num_not_logged"] == 0 and books["num_status_differs"] == 0
          and result["after"]["num_requests_running"] == result["after"]["num_requests_waiting"] == 0
          and result["after"]["kv_blocks_leaked"] == 0 and result["anon_rss_mib"]["growth"] < RSS_GROWTH_BOUND_MIB)
    result["passed"] = ok
    (args.out / "soak.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / "soak.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if ok else 1


def markdown(r: dict) -> str:
    rows = [("requests", r["num_requests"]), ("concurrency", r["concurrency"]),
            ("wall time", f"{r['wall_s']} s ({r['requests_per_s']} requests/s)"),
            ("client disconnects (before first token / mid-stream / during prefill)",
             f"{r['num_disconnects']} ({r['outcomes'].get('left:before_first_token', 0)} / "
             f"{r['outcomes'].get('left:mid_stream', 0)} / {r['outcomes'].get('left:during_prefill', 0)})"),
            ("requests past --request-timeout (504)", r["num_timeouts"]),
            ("step faults injected (requests they failed)",
             f"{r['num_faults_injected']} ({r['num_requests_failed_by_faults']})"),
            ("outcomes", ", ".join(f"{k}: {v}" for k, v in r["outcomes"].items())),
            ("requests lost", r["num_lost"]), ("undocumented 5xx", r["num_5xx_undocumented"]),
            ("logged twice / seen by the client but not logged / status differs",
             f"{r['request_log']['num_logged_twice']} / {r['request_log']['num_not_logged']} / "
             f"{r['request_log']['num_status_differs']}"),
            ("after: running / waiting / KV usage / KV blocks leaked",
             f"{r['after']['num_requests_running']:g} / {r['after']['num_requests_waiting']:g} / "
             f"{r['after']['kv_cache_usage_perc']:g} / {r['after']['kv_blocks_leaked']:g}"),
            ("server anonymous RSS after warm-up (10%) -> end",
             f"{r['anon_rss_mib']['after_warmup']} -> {r['anon_rss_mib']['end']} MiB "
             f"({r['anon_rss_mib']['growth']:+} MiB; bound {r['anon_rss_mib']['bound']} MiB)"),
            ("server RSS (with file-backed pages) after warm-up -> end",
             f"{r['rss_mib']['after_warmup']} -> {r['rss_mib']['end']} MiB ({r['rss_mib']['growth']:+} MiB)"),
            ("load average before / after", f"{r['load_average']['before'][0]} / {r['load_average']['after'][0]}"),
            ("passed", r["passed"])]
    lines = [f"# Soak ({r['date']})", "", f"`{r['command']}` against `{r['server']}`", "", "| | |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
