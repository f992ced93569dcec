"""A server with --request-timeout, the API key from $SERVELAB_API_KEY and --protect-metrics; last,
SIGTERM with a grace too short for the request in flight."""
from __future__ import annotations

import json
import signal
import threading
import time

import httpx
import openai
import pytest

from servelab.testing.server import TINY_ENGINE_FLAGS, parse_sse, wait_for_metrics

KEY = "env-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
TIMEOUT_S = 1.0
# 8 samples of 500 tokens, one at a time (--max-num-seqs 1): 4,000 steps, far past the limit however fast the
# machine (one sample alone finished within 1 s on a quiet Zen 4)
LONG = {"prompt": "Keep going", "max_tokens": 500, "ignore_eos": True, "n": 8}


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--max-num-seqs", "1", "--request-timeout", str(TIMEOUT_S),
                          "--protect-metrics", "--shutdown-grace", "0.2", env={"SERVELAB_API_KEY": KEY})
    yield server
    server.stop()


def idle(values: dict) -> bool:
    return values["servelab:kv_cache_usage_perc"] == 0 and values["servelab:num_requests_running"] == 0


def test_metrics_protected_and_key_from_env(server):
    assert httpx.get(f"{server.url}/metrics").status_code == 401
    assert httpx.get(f"{server.url}/v1/metrics/stream").status_code == 401
    assert httpx.get(f"{server.url}/metrics", headers=AUTH).status_code == 200
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_streaming_timeout_ends_with_error_event(server):
    response = httpx.post(f"{server.url}/v1/completions", json={**LONG, "stream": True}, headers=AUTH, timeout=60)
    payloads = parse_sse(response.text)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "request_timeout" and error["type"] == "timeout_error"
    assert len(payloads) > 2  # some tokens arrived before the limit
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0)
    started = time.monotonic()
    with pytest.raises(openai.APIError, match="limit"):
        for _ in client.completions.create(model=client.models.list().data[0].id, prompt=LONG["prompt"],
                                           max_tokens=LONG["max_tokens"], n=LONG["n"], stream=True,
                                           extra_body={"ignore_eos": True}):
            pass
    assert time.monotonic() - started < TIMEOUT_S + 5
    wait_for_metrics(server.url, idle, headers=AUTH)


def test_non_streaming_timeout_is_504(server):
    response = httpx.post(f"{server.url}/v1/completions", json=LONG, headers=AUTH, timeout=60)
    assert response.status_code == 504
    assert response.json()["error"]["code"] == "request_timeout"
    wait_for_metrics(server.url, idle, headers=AUTH)


def test_sigterm_grace_expiry_fails_in_flight_and_exits(server):
    result = {}

    def stream():
        with httpx.Client(timeout=60) as http:
            result["response"] = http.post(f"{server.url}/v1/completions", json={**LONG, "stream": True},
                                           headers=AUTH)

    thread = threading.Thread(target=stream)
    thread.start()
    wait_for_metrics(server.url, lambda v: v["servelab:num_requests_running"] >= 1, headers=AUTH)
    server.signal(signal.SIGTERM)
    thread.join(timeout=30)
    payloads = parse_sse(result["response"].text)
    assert payloads[-1] == "[DONE]"
    assert json.loads(payloads[-2])["error"]["code"] == "shutting_down"
    assert server.proc.wait(timeout=30) == 0
