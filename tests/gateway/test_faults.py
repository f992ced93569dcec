"""Injected faults against the real gateway process (the stub executor's test-only hook, tests/engine/
stub_engine.py; no user flag): a failing step ends only the requests it ran (queued ones go on) and /health
says so; a fault the engine cannot survive ends everything with engine_dead, the API process stays up
answering 503 for --shutdown-grace, then exits 1; SIGTERM under load drains with every request answered; an
unusable cache folder is one clear line at start."""
from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import threading
import time

import httpx
import pytest

from servelab.testing.server import parse_sse, servelab_command, wait_for_metrics
from servelab.entrypoints import cache_dir


def idle(values: dict) -> bool:
    return (values["servelab:num_requests_running"] == values["servelab:num_requests_waiting"] == 0
            and values["servelab:kv_cache_usage_perc"] == 0)


def test_a_failing_step_fails_its_requests_and_health_says_so(start_stub_server):
    server = start_stub_server("--stub-fail-word", "hello")
    faulty = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi hello", "max_tokens": 4}, timeout=30)
    assert faulty.status_code == 500 and faulty.json()["error"]["code"] == "engine_step_failed"
    assert "injected fault" in faulty.json()["error"]["message"]
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 200
    assert health.json()["num_failed_steps"] == 1 and "injected fault" in health.json()["last_step_error"]
    after = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=30)
    assert after.status_code == 200 and after.json()["choices"][0]["text"] == " w1 w2 w3"
    wait_for_metrics(server.url, idle)
    assert server.proc.poll() is None


def test_a_failing_step_leaves_the_requests_it_did_not_run(start_stub_server):
    # One batch slot: "first" runs alone while "faulty" and then "queued" wait in the engine; faulty's own
    # step fails, and queued (in the engine, not in that step) is served afterwards.
    server = start_stub_server("--stub-fail-word", "hello", "--stub-max-num-seqs", "1", "--stub-step-delay", "0.05")
    results: dict[str, httpx.Response] = {}

    def send(name: str, prompt: str, max_tokens: int) -> None:
        results[name] = httpx.post(f"{server.url}/v1/completions", json={"prompt": prompt, "max_tokens": max_tokens},
                                   timeout=60)

    threads = [threading.Thread(target=send, args=args) for args in
               (("first", "hi", 30), ("faulty", "hi hello", 4), ("queued", "hi", 3))]
    for thread in threads:
        thread.start()
        time.sleep(0.3)  # arrival order: first is running before faulty and queued arrive, in that order
    for thread in threads:
        thread.join(timeout=60)
    assert results["first"].status_code == 200
    assert results["faulty"].status_code == 500 and results["faulty"].json()["error"]["code"] == "engine_step_failed"
    assert results["queued"].status_code == 200, results["queued"].text
    assert results["queued"].json()["choices"][0]["text"] == " w1 w2 w3"
    wait_for_metrics(server.url, idle)


def test_a_fault_the_engine_cannot_survive_ends_everything_with_engine_dead(start_stub_server):
    server = start_stub_server("--stub-fatal-word", "hello", "--stub-step-delay", "0.01", "--shutdown-grace", "3")
    result = {}

    def long_stream():
        body = {"prompt": "hi", "max_tokens": 1500, "ignore_eos": True, "stream": True}
        result["stream"] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)

    thread = threading.Thread(target=long_stream)
    thread.start()
    wait_for_metrics(server.url, lambda v: v["servelab:num_requests_running"] == 1)
    fatal = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=30)
    thread.join(60)
    assert fatal.status_code == 503 and fatal.json()["error"]["code"] == "engine_dead"
    frames = parse_sse(result["stream"].text)
    assert frames[-1] == "[DONE]" and json.loads(frames[-2])["error"]["code"] == "engine_dead"
    health = httpx.get(f"{server.url}/health", timeout=10)  # the API process is still up
    assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
    assert "FatalFault" in health.json()["error"]["message"]
    again = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert again.status_code == 503 and again.json()["error"]["code"] == "engine_dead"
    assert server.proc.wait(timeout=60) == 1  # after --shutdown-grace, for a supervisor to restart it


def test_sigterm_under_load_answers_every_request_then_exits_0(start_stub_server):
    server = start_stub_server("--stub-step-delay", "0.01", "--shutdown-grace", "60")
    num_requests = 24
    responses: dict[int, httpx.Response] = {}

    def one(i: int) -> None:
        # 300 steps of 10 ms: every request is in before the first one finishes
        body = {"prompt": f"hi w{i % 32}", "max_tokens": 300, "ignore_eos": True, "stream": i % 2 == 0, "n": 1 + i % 3}
        responses[i] = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(num_requests)]
    for t in threads:
        t.start()
    wait_for_metrics(server.url, lambda v: v["servelab:num_requests_running"] + v["servelab:num_requests_waiting"]
                     >= sum(1 + i % 3 for i in range(num_requests)))  # all in: a later one would get 503
    server.signal(signal.SIGTERM)
    refused = None
    for _ in range(50):  # a request that arrives while draining
        try:
            refused = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi"}, timeout=10)
            break
        except httpx.ConnectError:
            time.sleep(0.05)
    for t in threads:
        t.join(120)
    assert len(responses) == num_requests
    for i, response in responses.items():
        assert response.status_code == 200, (i, response.text)
        if i % 2 == 0:
            payloads = parse_sse(response.text)
            assert payloads[-1] == "[DONE]" and not any('"error"' in p for p in payloads), i
            finished = [c for p in payloads[:-1] for c in json.loads(p)["choices"] if c.get("finish_reason")]
            assert len(finished) == 1 + i % 3 and all(c["finish_reason"] == "length" for c in finished)
        else:
            choices = response.json()["choices"]
            assert len(choices) == 1 + i % 3 and all(c["finish_reason"] == "length" for c in choices)
    if refused is not None:
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert server.proc.wait(timeout=60) == 0


def test_unusable_cache_folder_is_a_clear_error_at_start(tmp_path):
    (tmp_path / "a-file").write_text("")
    for folder in (tmp_path / "a-file" / "cache", "/proc/servelab-cache"):
        run = subprocess.run([*servelab_command(), "serve", "--port", "0"], capture_output=True, text=True,
                             timeout=120, env={**os.environ, "SERVELAB_CACHE_DIR": str(folder)})
        assert run.returncode == 2, run.stderr
        assert run.stderr.startswith(f"servelab: error: the cache folder {folder} is not usable"), run.stderr
        assert "Traceback" not in run.stderr


def test_full_disk_is_named(tmp_path, monkeypatch):
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(cache_dir.tempfile, "NamedTemporaryFile", full)
    with pytest.raises(ValueError, match=f"the cache folder {tmp_path} is not usable \\(No space left on device\\)"):
        cache_dir.check_cache_dir(tmp_path)
    monkeypatch.undo()
    assert cache_dir.check_cache_dir(tmp_path) == tmp_path and not list(tmp_path.iterdir())
