"""`servelab serve --disaggregate P:D` for real: engine-core processes for prefill and decode, the KV blocks
sent between them over torch.distributed (gloo) point-to-point. Greedy outputs (a tiny model in fp32, the default
model as served by default) are token-identical to a colocated `-tp 1` server's; a flood with random client disconnects leaves no KV
block used on any instance; a decode instance killed with SIGKILL mid-stream ends the stream with an
`engine_dead` error event, /health answers 503 and the server exits 1, leaving no process behind."""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal

import httpx
import pytest

from servelab.engine_args import EngineArgs
from servelab.model.quant.auto_quantization import resolve_quantization
from servelab.testing.server import flood_with_disconnects, TINY_ENGINE_FLAGS, children, parse_sse, wait_for_metrics, wait_gone

GRACE_S = 5.0
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
           "The three primary colors are", "To make a cup of tea, first", "Water boils at a temperature of",
           "The largest planet in our solar system is", "In machine learning, a neural network"]


def engine_pids(server) -> tuple[list[int], list[int]]:
    """(every engine core, the prefill ones)."""
    match = re.search(r"engine cores ready: pids ([\d, ]+) \(prefill: ([\d, ]+)\)", server.log())
    assert match, server.log()
    return [int(p) for p in match.group(1).split(", ")], [int(p) for p in match.group(2).split(", ")]


def greedy_texts(url: str, max_tokens: int = 24) -> list[tuple[str, int]]:
    async def one(http: httpx.AsyncClient, prompt: str) -> tuple[str, int]:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        response = await http.post(f"{url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        data = response.json()
        return data["choices"][0]["text"], data["usage"]["completion_tokens"]

    async def run_all():
        async with httpx.AsyncClient(timeout=300) as http:
            return await asyncio.gather(*(one(http, p) for p in PROMPTS))

    return asyncio.run(run_all())


def idle_everywhere(num_engines: int):
    def idle(v: dict) -> bool:
        return all(v[f"servelab:{name}{{engine={i}}}"] == 0 for i in range(num_engines)
                   for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"))
    return idle


# (layers, KV heads, head dim) of the two models
SHAPES = {"tiny": (2, 2, 16), "default": (30, 3, 64)}


@pytest.mark.parametrize("model,precision,kv_dtype", [
    ("tiny", ("--dtype", "float32"), "float32"),
    ("tiny", ("--dtype", "float32", "--kv-cache-dtype", "int8"), "int8"),
    pytest.param("default", (), None, marks=pytest.mark.slow)], ids=["fp32", "fp32-kv-int8", "default-flags"])
def test_disaggregated_greedy_output_is_token_identical_to_colocated(start_server, request, model, precision,
                                                                     kv_dtype):
    """An int8 cache's blocks move with their scales (a row: head-dim values and a 4-byte scale). The fp32 rows
    are checked on the tiny model (what moves is the same code for any shape); the default model runs with no
    precision flags, as a user serves it (--quantization auto: int8 weights and KV cache, where every row's int8
    products are exact integer sums, so the split gives the same tokens as the colocated server there too)."""
    folder = request.getfixturevalue("tiny_llama_dir") if model == "tiny" else None
    flags = (*precision, "--num-threads", "1", "--num-kv-blocks", "256")
    if kv_dtype is None:  # what auto picks here: int8 rows, or bf16 ones where the kernels are missing
        kv_dtype = "int8" if resolve_quantization(EngineArgs()).kv_cache_dtype == "int8" else "bfloat16"
    layers, kv_heads, head_dim = SHAPES[model]
    row_bytes = {"float32": head_dim * 4, "bfloat16": head_dim * 2, "int8": head_dim + 4}[kv_dtype]
    colocated = start_server(folder, *flags, "-tp", "1")
    expected = greedy_texts(colocated.url)
    colocated.stop()
    server = start_server(folder, *flags, "--disaggregate", "1:1")
    assert greedy_texts(server.url) == expected
    assert all(n == 24 for _, n in expected)
    values = wait_for_metrics(server.url, idle_everywhere(2))
    # every prompt went 0 -> 1: the first token on the prefill instance, the rest on the decode instance
    assert values["servelab:generation_tokens_total{engine=0}"] == len(PROMPTS)
    assert values["servelab:generation_tokens_total{engine=1}"] == 23 * len(PROMPTS)
    assert values["servelab:kv_transfer_time_seconds_count{engine=0}"] == len(PROMPTS)
    # whole blocks move: 16 tokens x layers x K,V x KV heads x a row each
    block_bytes = 16 * layers * 2 * kv_heads * row_bytes
    assert values["servelab:kv_transfer_bytes_total{engine=0}"] % block_bytes == 0
    assert values["servelab:kv_transfer_bytes_total{engine=0}"] >= len(PROMPTS) * block_bytes
    for i in (0, 1):
        assert values[f"servelab:kv_cache_num_free_blocks{{engine={i}}}"] == 256


@pytest.fixture(scope="module")
def pd12(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--disaggregate", "1:2", "--max-num-seqs", "8")
    yield server
    server.stop()


def test_flood_with_random_disconnects_leaves_no_block_used_on_any_instance(pd12):
    leave_after = flood_with_disconnects(pd12.url, 32, seed=0, max_tokens=40,
                                         prompt=lambda i: f"Flood {i} goes " * (1 + i % 6))
    values = wait_for_metrics(pd12.url, idle_everywhere(3))
    for i in (0, 1, 2):
        assert values[f"servelab:kv_cache_num_free_blocks{{engine={i}}}"] == \
            values[f"servelab:kv_cache_num_blocks{{engine={i}}}"]
    assert values["servelab:request_success_total{finished_reason=abort}"] >= leave_after.count(1)
    assert values["servelab:kv_transfer_time_seconds_count{engine=0}"] >= leave_after.count(None)
    assert all(values[f"servelab:generation_tokens_total{{engine={i}}}"] > 0 for i in (1, 2))


def test_killed_decode_instance_ends_the_stream_and_the_server_exits_1(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--disaggregate", "1:1",
                          "--shutdown-grace", str(GRACE_S))
    engines, prefill = engine_pids(server)
    [decode] = [p for p in engines if p not in prefill]
    processes = children(server.proc.pid)
    assert set(engines) <= set(processes)
    body = {"prompt": "Keep talking", "max_tokens": 480, "ignore_eos": True, "stream": True}
    lines = []
    with httpx.Client(timeout=30) as http:  # the bound on how long the stream may take to end
        with http.stream("POST", f"{server.url}/v1/completions", json=body) as response:
            for line in response.iter_lines():
                lines.append(line)
                if sum(x.startswith("data: ") for x in lines) == 5:  # well into decoding on the decode instance
                    os.kill(decode, signal.SIGKILL)
    payloads = parse_sse("".join(f"{line}\n" if line else "\n" for line in lines))
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["code"] == "engine_dead" and "killed by signal 9" in error["message"], error
    health = httpx.get(f"{server.url}/health", timeout=10)
    assert health.status_code == 503 and "killed by signal 9" in health.json()["error"]["message"]
    assert server.proc.wait(timeout=GRACE_S + 20) == 1
    assert wait_gone(processes) == []


def test_live_layout_shows_the_instances_roles_and_their_kv_handoffs(pd12):
    before = httpx.get(f"{pd12.url}/lab/api/live/layout", timeout=10).json()["engines"]
    for i in range(4):
        body = {"prompt": f"Layout {i}", "max_tokens": 3, "ignore_eos": True}
        assert httpx.post(f"{pd12.url}/v1/completions", json=body, timeout=60).status_code == 200
    engines = httpx.get(f"{pd12.url}/lab/api/live/layout", timeout=10).json()["engines"]
    assert [e["role"] for e in engines] == ["prefill", "decode", "decode"]
    sent = engines[0]["num_kv_handoffs"] - before[0]["num_kv_handoffs"]
    received = sum(e["num_kv_handoffs"] - b["num_kv_handoffs"] for e, b in zip(engines[1:], before[1:]))
    assert sent == received == 4
