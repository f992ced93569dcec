"""`servelab serve -tp 2` (tiny model): a flood with random client disconnects leaves every KV block free,
and a tensor-parallel worker killed with SIGKILL mid-stream ends the stream with an `engine_dead` error
event naming the rank, /health reports 503, and the server exits 1 after --shutdown-grace with every
process it started gone."""
from __future__ import annotations

import json
import os
import re
import signal

import httpx
import pytest
from servelab.testing.server import flood_with_disconnects, TINY_ENGINE_FLAGS, children, parse_sse, wait_for_metrics, wait_gone

GRACE_S = 5.0


def rank_pids(server) -> list[int]:
    match = re.search(r"tensor-parallel ranks ready: (.*)", server.log())
    assert match, server.log()
    return [int(pid) for pid in re.findall(r"rank \d+ pid (\d+)", match.group(1))]


@pytest.fixture(scope="module")
def tp2(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "-tp", "2", "--max-num-seqs", "8")
    yield server
    server.stop()


def test_tp2_flood_with_random_disconnects_frees_every_block(tp2):
    assert len(rank_pids(tp2)) == 2
    leave_after = flood_with_disconnects(tp2.url, 24, seed=1, max_tokens=30)

    def idle(v: dict) -> bool:
        return all(v[f"servelab:{name}"] == 0
                   for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))

    values = wait_for_metrics(tp2.url, idle)
    assert values["servelab:kv_cache_num_free_blocks"] == values["servelab:kv_cache_num_blocks"]
    assert values["servelab:request_success_total{finished_reason=abort}"] >= leave_after.count(1)
    assert values["servelab:request_success_total{finished_reason=length}"] >= leave_after.count(None)


def test_killed_tp_worker_ends_streams_and_the_server_exits_1(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "-tp", "2", "--shutdown-grace", str(GRACE_S))
    ranks = rank_pids(server)
    processes = [p for pid in children(server.proc.pid) for p in [pid, *children(pid)]]
    assert set(ranks) <= set(processes)
    body = {"prompt": "Keep talking", "max_tokens": 480, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=30) as http:  # the bound on how long the stream may take to end
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                if sum(x.startswith("data: ") for x in lines) == 3:
                    os.kill(ranks[1], signal.SIGKILL)
    payloads = parse_sse("".join(f"{line}\n" if line else "\n" for line in lines))
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    cause = f"rank 1 (pid {ranks[1]}) was killed by SIGKILL"
    assert error["code"] == "engine_dead" and cause in error["message"], error
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and cause in health.json()["error"]["message"]
    late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert server.proc.wait(timeout=GRACE_S + 20) == 1
    assert wait_gone(processes) == []
