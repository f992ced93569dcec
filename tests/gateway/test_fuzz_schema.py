"""Schemathesis fuzzes /v1/* of a real gateway process (stub engine, an API key) from the OpenAPI schema the
server publishes (servelab/testing/fuzz.py): every response is a documented status whose body fits the
schema (errors: OpenAI's error body), there is no 5xx (503/504 come only from draining, a dead engine or a
timeout, none of which happens here), and the server keeps serving. A bounded run; benchmarks/fuzz/run.py runs
longer."""
from __future__ import annotations

import httpx

from servelab.testing.fuzz import run_fuzz

API_KEY = "fuzz-key"
EXAMPLES_PER_MODE = 50  # 3 operations x 2 modes: 300 cases, plus the unlisted methods
STUB_FLAGS = ("--api-key", API_KEY, "--stub-max-model-len", "256", "--stub-num-blocks", "512",
              "--max-num-queued-requests", "10000", "--max-queued-tokens", "100000000", "--log-level", "warning")


def test_fuzz_v1_against_its_own_schema_then_the_server_still_serves(start_stub_server):
    server = start_stub_server(*STUB_FLAGS)
    report = run_fuzz(server.url, API_KEY, EXAMPLES_PER_MODE, seed=1)
    assert not report.failures, "\n".join(report.failures[:20])
    assert report.num_cases >= 300 and report.num_5xx == 0, report
    assert report.statuses[200] > 0 and report.statuses[400] > 0 and report.statuses[401] > 0, report.statuses
    headers = {"Authorization": f"Bearer {API_KEY}"}
    response = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3},
                          headers=headers, timeout=30)
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " w1 w2 w3"
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200 and health.json()["num_failed_steps"] == 0
