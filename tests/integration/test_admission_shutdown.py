"""A server with a tiny queue: 429 under a flood with nothing lost, then SIGTERM drain (last: it
stops the server)."""
from __future__ import annotations

import asyncio
import json
import signal
import threading
import time

import httpx
import pytest

from servelab.testing.server import TINY_ENGINE_FLAGS, children, metric_values, parse_sse, wait_gone

MAX_QUEUED = 2


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--max-num-seqs", "2",
                          "--max-num-queued-requests", str(MAX_QUEUED), "--shutdown-grace", "30")
    yield server
    server.stop()


def test_flood_gets_429_and_loses_nothing(server):
    num_requests = 24

    async def one(http: httpx.AsyncClient, i: int) -> httpx.Response:
        body = {"prompt": f"Flood {i}", "max_tokens": 8, "ignore_eos": True}
        return await http.post(f"{server.url}/v1/completions", json=body)

    async def flood():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=num_requests)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(num_requests)))

    responses = asyncio.run(flood())
    ok = [r for r in responses if r.status_code == 200]
    rejected = [r for r in responses if r.status_code == 429]
    assert len(ok) + len(rejected) == num_requests, [r.status_code for r in responses]
    assert ok and rejected
    for r in ok:
        body = r.json()
        assert body["usage"]["completion_tokens"] == 8 and body["choices"][0]["finish_reason"] == "length"
    for r in rejected:
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
    values = metric_values(server.url)
    assert values["servelab:num_requests_rejected_total{reason=queue_full}"] == len(rejected)
    assert values["servelab:request_success_total{finished_reason=length}"] == len(ok)


def test_sigterm_drains_in_flight_requests_then_exits(server):
    result = {}

    def stream():
        body = {"prompt": "Drain me", "max_tokens": 120, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=60) as http:
            result["response"] = http.post(f"{server.url}/v1/completions", json=body)

    thread = threading.Thread(target=stream)
    thread.start()
    deadline = time.monotonic() + 20
    while metric_values(server.url)["servelab:num_requests_running"] < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    processes = children(server.proc.pid)
    assert processes  # the engine core
    server.signal(signal.SIGTERM)
    deadline = time.monotonic() + 10
    refused = None
    while refused is None and time.monotonic() < deadline:  # the signal is handled asynchronously
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "late", "max_tokens": 1}, timeout=10)
        refused = r if r.status_code == 503 else None
    assert refused is not None and refused.json()["error"]["code"] == "shutting_down"
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
    thread.join(timeout=60)
    payloads = parse_sse(result["response"].text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum(len(c["choices"][0]["text"]) > 0 for c in chunks) >= 1
    assert server.proc.wait(timeout=30) == 0
    assert wait_gone(processes) == []  # the engine core was told to stop (or killed)
