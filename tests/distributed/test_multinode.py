"""Two "nodes" on 127.0.0.1: `servelab serve -tp 2 --nnodes 2` (node 0: API server, engine core, rank 0) and
`servelab serve --headless --node-rank 1` (rank 1 only), joined through torch.distributed's rendezvous store
at --master-addr:--master-port. Greedy output identical to -tp 1, every process gone after node 0 stops,
and the multi-node flags that cannot work refused before anything loads."""
from __future__ import annotations

import asyncio
import re
import signal

import httpx
import pytest
from servelab.testing.server import TINY_ENGINE_FLAGS, ServerProcess, children, free_port, wait_gone

from servelab import LLM, SamplingParams
from servelab.config import ParallelConfig
from servelab.entrypoints.cli import main

PROMPTS = [f"Node test {i} says" for i in range(6)]


@pytest.mark.parametrize("kwargs, message", [
    (dict(tensor_parallel_size=2, nnodes=2, node_rank=2, master_port=1234), r"node_rank must be in 0 \.\. .* = 1"),
    (dict(tensor_parallel_size=3, nnodes=2, master_port=1234), "cannot be spread evenly over 2 nodes"),
    (dict(tensor_parallel_size=1, nnodes=2, master_port=1234), "cannot be spread evenly over 2 nodes"),
    (dict(tensor_parallel_size=2, nnodes=2), "master_port is required with nnodes > 1"),
    (dict(tensor_parallel_size=2, nnodes=0), "nnodes must be >= 1"),
    (dict(tensor_parallel_size=2, master_port=70000), "master_port must be in 1 .. 65535"),
])
def test_bad_parallel_configs(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ParallelConfig(**kwargs)


def test_local_ranks_of_each_node():
    assert [list(ParallelConfig(6, nnodes=3, node_rank=n, master_port=1).local_ranks) for n in range(3)] == [
        [0, 1], [2, 3], [4, 5]]


@pytest.mark.parametrize("flags, message", [
    (["--nnodes", "2", "-tp", "2", "--node-rank", "1", "--master-port", "1234"], "add --headless"),
    (["--headless"], "--headless is for nodes with --node-rank > 0"),
    (["--nnodes", "2", "-tp", "4", "-dp", "2", "--master-port", "1234"], "cannot be combined with --data-parallel"),
    (["--nnodes", "2", "-tp", "2", "--node-rank", "2", "--master-port", "1234", "--headless"], "node_rank must be"),
])
def test_serve_refuses_bad_node_flags_before_loading(flags, message, capsys):
    assert main(["serve", "/nonexistent/model", *flags]) == 2
    assert message in capsys.readouterr().err


def headless_node(model, port: int, tmp_path, *flags: str) -> ServerProcess:
    return ServerProcess(str(model), ("--headless", "--nnodes", "2", "--node-rank", "1", "--master-addr", "127.0.0.1",
                                      "--master-port", str(port), "-tp", "2", *flags), tmp_path / "node1.log")


def test_offline_llm_over_two_nodes_matches_one_process(tiny_llama_dir, tmp_path):
    prompts = [[5 + i, 300 + 7 * i, 1000 + i] * (i + 1) for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    single = LLM(str(tiny_llama_dir), dtype="float32", num_threads=1, num_kv_blocks=64)
    expected = [o.outputs[0].token_ids for o in single.generate([{"prompt_token_ids": p} for p in prompts], params)]
    port = free_port()
    node1 = headless_node(tiny_llama_dir, port, tmp_path, "--dtype", "float32", "--num-kv-blocks", "64",
                          "--num-threads", "1")
    try:
        llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=64, num_threads=1, tensor_parallel_size=2,
                  nnodes=2, master_port=port)
        try:
            ranks = llm.engine.executor.worker_ranks
            assert [r.rank for r in ranks] == [0, 1]
            assert ranks[1].pid in children(node1.proc.pid)  # rank 1 is the headless node's process
            got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
            assert [o.outputs[0].token_ids for o in got] == expected
        finally:
            llm.shutdown()
        assert node1.proc.wait(timeout=60) == 0, node1.log()
    finally:
        node1.stop()
    assert wait_gone([r.pid for r in ranks]) == []


def test_server_over_two_nodes_matches_one_process(start_server, tiny_llama_dir, tmp_path):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=512, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate(PROMPTS, params)]
    port = free_port()
    node1 = headless_node(tiny_llama_dir, port, tmp_path, *TINY_ENGINE_FLAGS)
    try:
        node0 = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "-tp", "2", "--nnodes", "2", "--master-addr",
                             "127.0.0.1", "--master-port", str(port))
        node1_processes = children(node1.proc.pid)  # rank 1, and multiprocessing's resource tracker
        [rank1] = map(int, re.findall(r"headless node 1 of 2: tensor-parallel ranks 1 \(pids (\d+)\)", node1.log()))
        assert rank1 in node1_processes
        node0_processes = children(node0.proc.pid)

        async def one(http: httpx.AsyncClient, prompt: str) -> str:
            body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
            response = await http.post(f"{node0.url}/v1/completions", json=body)
            assert response.status_code == 200, response.text
            return response.json()["choices"][0]["text"]

        async def run_all():
            async with httpx.AsyncClient(timeout=120) as http:
                return await asyncio.gather(*(one(http, p) for p in PROMPTS))

        assert asyncio.run(run_all()) == expected
        node0.signal(signal.SIGTERM)
        assert node0.proc.wait(timeout=60) == 0, node0.log()
        assert node1.proc.wait(timeout=60) == 0, node1.log()
        engine_processes = [p for pid in node0_processes for p in [pid, *children(pid)]]
        assert wait_gone(engine_processes + node1_processes) == []
    finally:
        node1.stop()
