"""Measure how fast /health answers while the engine is busy, with the engine core in its own process
(the default) and in a thread of the API server (--engine-in-process). Not a test.

    python benchmarks/health_latency/run.py [--prefill-tokens 500] [--streams 32] [--repeats 2] \
        [-- serve flags]

Each mode: start `servelab serve` (default model), then (prefill) send one prompt of --prefill-tokens ids
with max_tokens 1, and (decode) --streams concurrent requests of 64 output tokens; meanwhile GET /health
back to back (10 ms apart) and report the latencies of the answers that came while the work ran.
"""
from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from servelab.testing.server import ServerProcess

DEFAULT_FLAGS = ("--dtype", "float32", "--num-threads", "2", "--kv-cache-memory", "1")


def prefill_work(url: str, prefill_tokens: int) -> None:
    body = {"prompt": [1000 + i % 500 for i in range(prefill_tokens)], "max_tokens": 1}
    httpx.post(f"{url}/v1/completions", json=body, timeout=600).raise_for_status()


def decode_work(url: str, num_streams: int) -> None:
    async def run_all():
        async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=num_streams)) as http:
            responses = await asyncio.gather(*(http.post(f"{url}/v1/completions", json={
                "prompt": f"Stream {i} says", "max_tokens": 64, "ignore_eos": True}) for i in range(num_streams)))
        for response in responses:
            response.raise_for_status()

    asyncio.run(run_all())


def measure(url: str, work) -> tuple[float, list[float]]:
    result = {}

    def run():
        started = time.perf_counter()
        work()
        result["seconds"] = time.perf_counter() - started

    thread = threading.Thread(target=run)
    latencies = []
    with httpx.Client(timeout=60) as http:
        thread.start()
        while thread.is_alive():
            started = time.perf_counter()
            http.get(f"{url}/health").raise_for_status()
            if thread.is_alive():
                latencies.append(time.perf_counter() - started)
            time.sleep(0.01)
    thread.join()
    return result["seconds"], latencies


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prefill-tokens", type=int, default=500)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("flags", nargs="*", help="serve flags (after --)")
    args = parser.parse_args()
    flags = tuple(args.flags) or DEFAULT_FLAGS
    for mode, extra in (("engine-core process", ()), ("thread (--engine-in-process)", ("--engine-in-process",))):
        log = Path(tempfile.mkdtemp()) / "server.log"
        server = ServerProcess(None, (*flags, *extra), log)
        try:
            server.wait_ready(600)
            workloads = ((f"{args.prefill_tokens}-token prefill", lambda: prefill_work(server.url, args.prefill_tokens)),
                         (f"{args.streams} streams x 64 tokens", lambda: decode_work(server.url, args.streams)))
            for name, work in workloads:
                for _ in range(args.repeats):
                    seconds, latencies = measure(server.url, work)
                    print(f"{mode}: {name} took {seconds:.2f} s; /health answered {len(latencies)} times "
                          f"meanwhile, median {statistics.median(latencies) * 1e3:.1f} ms, "
                          f"p90 {statistics.quantiles(latencies, n=10)[-1] * 1e3:.1f} ms, "
                          f"max {max(latencies) * 1e3:.1f} ms", flush=True)
        finally:
            server.stop()


if __name__ == "__main__":
    main()
