"""Measure TTFT and output tokens/s of a servelab server for 1 and for N concurrent streams (not a test).

    python benchmarks/streams/run.py                 # starts `servelab serve` (default model)
    python benchmarks/streams/run.py --url http://127.0.0.1:8000

Client-side timing: TTFT is request sent -> first chunk with text; tokens/s is completion tokens
(from the usage chunk) over the wall time of the batch. Statistics come from
servelab.metrics.request_stats, the same definitions the server's /metrics use.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

import httpx

from servelab.metrics.request_stats import RequestTiming, compute_metrics
from servelab.testing.server import ServerProcess

PROMPT = "Explain in a few sentences why a KV cache speeds up LLM inference."


async def one_stream(http: httpx.AsyncClient, url: str, max_tokens: int) -> RequestTiming:
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    sent = time.perf_counter()
    token_times, usage = [], None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            elif chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                token_times.append(time.perf_counter())
    return RequestTiming(usage["prompt_tokens"], usage["completion_tokens"], sent, token_times[0], token_times[-1],
                         token_times)


async def run_batch(url: str, concurrency: int, rounds: int, max_tokens: int) -> dict:
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=concurrency)) as http:
        timings, started = [], time.perf_counter()
        for _ in range(rounds):
            timings += await asyncio.gather(*(one_stream(http, url, max_tokens) for _ in range(concurrency)))
        return compute_metrics(timings, time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", help="a running server (default: start `servelab serve` with the default model)")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--single-rounds", type=int, default=3, help="sequential requests for concurrency 1")
    parser.add_argument("serve_args", nargs="*", help="extra `servelab serve` flags (after --)")
    args = parser.parse_args()
    server = None
    url = args.url
    if url is None:
        server = ServerProcess(None, tuple(args.serve_args), Path(tempfile.mkdtemp()) / "server.log")
        started = time.perf_counter()
        server.wait_ready(timeout=300)
        print(f"server ready in {time.perf_counter() - started:.1f} s", flush=True)
        url = server.url
    try:
        asyncio.run(run_batch(url, 1, 1, 8))  # warm-up
        for concurrency in args.concurrency:
            rounds = args.single_rounds if concurrency == 1 else 1
            m = asyncio.run(run_batch(url, concurrency, rounds, args.max_tokens))
            print(f"concurrency {concurrency:3d}: {m['completed']} requests x {args.max_tokens} tokens | "
                  f"TTFT mean {m['mean_ttft_ms']:.0f} ms, p99 {m['p99_ttft_ms']:.0f} ms | "
                  f"TPOT mean {m['mean_tpot_ms']:.1f} ms | output {m['output_throughput']:.1f} tok/s total, "
                  f"{1000 / m['mean_tpot_ms']:.1f} tok/s per stream", flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
