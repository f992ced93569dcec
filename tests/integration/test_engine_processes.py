"""`servelab serve` with its engine cores in their own processes (tiny model). `-dp 2`: two core processes
share the load with greedy outputs identical to one engine's, every KV block is free after a flood with
random disconnects, and a SIGKILL of the API server leaves no process behind (the lab's simulation
worker included). A core killed with SIGKILL mid-stream: the
stream ends with an `engine_dead` error event, /health and new requests get 503, and the server exits 1
after --shutdown-grace, stopping every process it started."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import httpx
import pytest

from pathlib import Path

from servelab import LLM, SamplingParams
from servelab.entrypoints.serve import OPENMP_SPIN_COUNT
from servelab.testing.server import flood_with_disconnects, TINY_ENGINE_FLAGS, children, metric_values, parse_sse, wait_for_metrics, wait_gone

GRACE_S = 5.0
PROMPTS = [f"Request {i} is about" for i in range(8)]


def engine_pids(server) -> list[int]:
    match = re.search(r"engine cores ready: pids ([\d, ]+)", server.log())
    assert match, server.log()
    return [int(p) for p in match.group(1).split(", ")]


# ---- -dp 2
@pytest.fixture(scope="module")
def dp2(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "-dp", "2", "--max-num-seqs", "8")
    yield server
    server.stop()


def test_two_engine_core_processes(dp2):
    pids = engine_pids(dp2)
    assert len(set(pids)) == 2 and dp2.proc.pid not in pids
    assert set(pids) <= set(children(dp2.proc.pid))
    if not {"OMP_WAIT_POLICY", "GOMP_SPINCOUNT"} & os.environ.keys():  # else the user's setting is inherited
        for pid in pids:  # the cores spin ~0.1 ms before their OpenMP threads sleep (serve.set_openmp_wait)
            environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0")
                           if "=" in item)
            assert environ.get("GOMP_SPINCOUNT") == OPENMP_SPIN_COUNT and "OMP_WAIT_POLICY" not in environ


def test_dp2_spreads_requests_with_the_same_greedy_outputs(dp2, tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=512, num_threads=1)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=12,
                                                                                    ignore_eos=True))]

    async def one(http: httpx.AsyncClient, prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        response = await http.post(f"{dp2.url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["text"]

    async def run_all():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*(one(http, p) for p in PROMPTS))

    assert asyncio.run(run_all()) == expected
    values = metric_values(dp2.url)
    per_engine = [values[f"servelab:generation_tokens_total{{engine={i}}}"] for i in (0, 1)]
    assert all(n > 0 for n in per_engine) and sum(per_engine) == values["servelab:generation_tokens_total"]
    assert values["servelab:generation_tokens_total"] >= 12 * len(PROMPTS)


def test_dp2_flood_with_random_disconnects_frees_every_block(dp2):
    leave_after = flood_with_disconnects(dp2.url, 32, seed=0, max_tokens=40)

    def idle(v: dict) -> bool:
        return all(v[f"servelab:{name}{{engine={i}}}"] == 0 for i in (0, 1)
                   for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))

    values = wait_for_metrics(dp2.url, idle)
    for i in (0, 1):
        assert values[f"servelab:kv_cache_num_free_blocks{{engine={i}}}"] == \
            values[f"servelab:kv_cache_num_blocks{{engine={i}}}"]
    assert values["servelab:request_success_total{finished_reason=abort}"] >= leave_after.count(1)


def test_dp2_api_server_killed_outright_leaves_no_process(dp2):
    """SIGKILL gives the server no chance to stop anything: its engine cores and the lab's worker notice that
    their parent is gone and exit by themselves."""
    before = set(children(dp2.proc.pid))
    # a lab simulation runs in a worker process of the server (not a thread sharing the event loop's GIL)
    lab = {"model": "llama-3.1-8b", "gpu": "h100", "dataset": "sharegpt-like", "num_prompts": 40, "request_rate": 4}
    simulated = httpx.post(f"{dp2.url}/lab/api/simulate", json=lab, timeout=120)
    assert simulated.status_code == 200 and simulated.json()["metrics"]["completed"] == 40
    pids = children(dp2.proc.pid)
    assert set(engine_pids(dp2)) <= before and len(set(pids) - before) >= 1  # the lab's worker
    dp2.signal(signal.SIGKILL)
    dp2.proc.wait(timeout=30)
    assert wait_gone(pids) == []


# ---- a core killed mid-stream
def test_killed_engine_core_ends_streams_and_the_server_exits_1(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--shutdown-grace", str(GRACE_S))
    [engine] = engine_pids(server)
    lab = {"model": "llama-3.1-8b", "gpu": "h100", "dataset": "sharegpt-like", "num_prompts": 20, "request_rate": 4}
    assert httpx.post(f"{server.url}/lab/api/simulate", json=lab, timeout=120).status_code == 200
    processes = children(server.proc.pid)
    assert engine in processes and len(processes) >= 2  # the engine core, the lab's worker
    body = {"prompt": "Keep talking", "max_tokens": 480, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=30) as http:  # the bound on how long the stream may take to end
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                if sum(x.startswith("data: ") for x in lines) == 3:
                    os.kill(engine, signal.SIGKILL)
    payloads = parse_sse("".join(f"{line}\n" if line else "\n" for line in lines))
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "engine_dead" and "killed by signal 9" in error["message"], error
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and "killed by signal 9" in health.json()["error"]["message"]
    late = httpx.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, timeout=10)
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert server.proc.wait(timeout=GRACE_S + 20) == 1
    assert wait_gone(processes) == []
