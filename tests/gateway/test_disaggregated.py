"""Disaggregated prefill/decode on stub engines in their own processes: a prefill core and a decode core
(real LLMEngine, scheduler and block manager; the stub executor keeps a real KV cache and samples "<unk>"
when any position of a request's context is missing from it), the KV blocks moved by the P2P connector over
gloo send/recv. Outputs match one colocated engine's, the first token streams before the decode core has
the request, KV bytes are reported, an abort at any phase and a flood of random aborts free every block on
both sides, and a decode core killed mid-stream fails its requests with engine_dead."""
import asyncio
import json
import os
import random
import signal

import httpx
import pytest

from servelab.engine.core_client import EngineDeadError, InprocClient
from servelab.engine.core_proc.core_process import EngineFactory
from servelab.engine.core_proc.disagg_launcher import launch_disaggregated
from servelab.gateway.app import Gateway, build_app
from servelab.engine.async_llm import AsyncLLM
from servelab.gateway.config import ServerConfig
from servelab.metrics.events import EngineState
from servelab.sampling_params import SamplingParams
from servelab.testing.stub_engine import UNK, make_engine, tiny_tokenizer, word_id

BLOCK_SIZE = 4
NUM_BLOCKS = 64
# bytes of one block of the stub's cache: K and V, block_size slots, 1 head of 2 floats, one layer
BLOCK_BYTES = 2 * BLOCK_SIZE * 1 * 2 * 4


def deployment(num_prefill=1, num_decode=1, **options):
    def factory_for(kv_config):
        return EngineFactory(make_engine, kwargs=dict(num_blocks=NUM_BLOCKS, block_size=BLOCK_SIZE,
                                                      kv_transfer=kv_config, **options))
    return launch_disaggregated(factory_for, num_prefill, num_decode, timeout=120, transfer_timeout_s=30)


def idle(state: EngineState) -> bool:
    return state.num_running == state.num_waiting == 0 and state.num_free_blocks == state.num_blocks


def run(cores, body, events):
    async def main():
        ae = AsyncLLM(cores, tiny_tokenizer(), on_events=events.append)
        ae.start()
        try:
            return await asyncio.wait_for(body(ae), timeout=60)
        finally:
            await ae.shutdown()
    return asyncio.run(main())


async def wait_idle(events, engines, rounds=500):
    """Until the last state each engine reported is idle (blocks freed after a send arrive as their own outputs)."""
    for _ in range(rounds):
        last = {e.engine_index: e.state for e in events}
        if set(engines) <= set(last) and all(idle(last[i]) for i in engines):
            return last
        await asyncio.sleep(0.01)
    return {e.engine_index: e.state for e in events}


def final(outputs):
    return [(c.token_ids, c.text, c.finish_reason) for c in outputs[-1].outputs]


REQUESTS = [(f"r{i}", [word_id(i)] * (i + 1), SamplingParams(max_tokens=3 + i)) for i in range(6)] + [
    ("eos", "hi", SamplingParams(max_tokens=20)),
    ("one", "hi hi", SamplingParams(max_tokens=1)),
    ("stop", "hi", SamplingParams(max_tokens=20, stop="w4")),
    ("long", [2] * 40, SamplingParams(max_tokens=5)),
]


async def scenario(ae):
    async def one(request_id, prompt, params):
        return request_id, final([o async for o in ae.generate(request_id, prompt, params)])
    return dict(await asyncio.gather(*(one(*r) for r in REQUESTS)))


def test_one_to_one_matches_a_colocated_engine_and_frees_every_block():
    colocated = run([InprocClient(make_engine(eos_at_position=9))], scenario, [])
    pd = deployment(eos_at_position=9, step_delay=0.002)
    pids = [c.pid for c in pd.cores]
    events = []

    async def body(ae):
        results = await scenario(ae)
        return results, await wait_idle(events, [0, 1])

    try:
        results, last = run(pd.cores, body, events)
    finally:
        pd.close()
    assert results == colocated
    assert all(UNK not in tokens for outs in results.values() for tokens, _, _ in outs)
    assert results["r2"] == [([word_id(p) for p in range(3, 8)], " w3 w4 w5 w6 w7", "length")]
    assert results["eos"][0][2] == "stop" and results["one"][0][2] == "length"
    assert all(idle(state) for state in last.values())
    # every request was prefilled on engine 0; those that needed more than the first token decoded on engine 1
    finished_on = {f.request_id: e.engine_index for e in events for f in e.finished}
    assert finished_on["eos"] == 1 and finished_on["r0"] == 1 and finished_on["one"] == 0
    sent = {t.request_id: t for e in events if e.engine_index == 0 for t in e.kv_transfers}
    assert set(sent) == {r[0] for r in REQUESTS} - {"one"}  # max_tokens 1: nothing to hand off
    assert sent["long"].num_bytes == 10 * BLOCK_BYTES and all(t.ok for t in sent.values())
    assert not any(t for e in events if e.engine_index == 1 for t in e.kv_transfers)
    assert all(not os.path.exists(f"/proc/{pid}/status") or _zombie(pid) for pid in pids)


def test_two_prefill_instances_share_the_prompts_and_hand_every_one_to_the_decode_instance():
    colocated = run([InprocClient(make_engine(eos_at_position=9))], scenario, [])
    pd = deployment(2, 1, eos_at_position=9, step_delay=0.01)
    events = []

    async def body(ae):
        results = await scenario(ae)
        return results, await wait_idle(events, [0, 1, 2])

    try:
        results, last = run(pd.cores, body, events)
    finally:
        pd.close()
    assert results == colocated
    assert all(idle(state) for state in last.values())
    sent_by = {t.request_id: e.engine_index for e in events for t in e.kv_transfers}
    assert set(sent_by) == {r[0] for r in REQUESTS} - {"one"}
    assert set(sent_by.values()) == {0, 1}  # the least-loaded prefill instance: both took prompts
    finished_on = {f.request_id: e.engine_index for e in events for f in e.finished}
    assert all(finished_on[request_id] == 2 for request_id in sent_by)


def _zombie(pid):
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def test_first_token_streams_before_the_decode_core_has_the_request():
    pd = deployment(step_delay=0.05)
    events = []

    async def body(ae):
        stream = await ae.add_request("s", [2, 3], SamplingParams(max_tokens=6, ignore_eos=True))
        first = await stream.__anext__()
        decode_seen = [e for e in events if e.engine_index == 1 and e.steps]
        last = first.copy()
        async for delta in stream:
            last.add(delta)
        return first, decode_seen, last

    try:
        first, decode_seen, last = run(pd.cores, body, events)
    finally:
        pd.close()
    assert first.outputs[0].token_ids == [word_id(2)] and not first.finished
    assert decode_seen == []
    assert last.outputs[0].token_ids == [word_id(p) for p in range(2, 8)] and last.finished


def test_aborts_in_every_phase_and_a_flood_free_every_block_on_both_sides():
    pd = deployment(1, 2, step_delay=0.003)
    events = []

    async def body(ae):
        # prefill phase: aborted before any token
        s = await ae.add_request("a-prefill", [2] * 30, SamplingParams(max_tokens=50))
        ae.abort("a-prefill")
        prefill_phase = [o async for o in s][-1].outputs[0]
        # transfer phase: aborted the moment the first token is out (the send has just been ordered)
        s = await ae.add_request("a-transfer", [3] * 30, SamplingParams(max_tokens=50))
        await s.__anext__()
        ae.abort("a-transfer")
        transfer_phase = [o async for o in s][-1].outputs[0]
        # decode phase
        s = await ae.add_request("a-decode", [2, 3], SamplingParams(max_tokens=500, ignore_eos=True))
        for _ in range(4):
            await s.__anext__()
        ae.abort("a-decode")
        decode_phase = [o async for o in s][-1].outputs[0]
        rng = random.Random(0)

        async def flood(i):
            stream = await ae.add_request(f"f{i}", [2] * (1 + i % 9), SamplingParams(max_tokens=40))
            leave_after = rng.choice([0, 1, 2, 5, None])
            if leave_after == 0:
                ae.abort(f"f{i}")
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == leave_after:
                    ae.abort(f"f{i}")

        await asyncio.gather(*(flood(i) for i in range(40)))
        return (prefill_phase, transfer_phase, decode_phase), await wait_idle(events, [0, 1, 2])

    try:
        phases, last = run(pd.cores, body, events)
    finally:
        pd.close()
    assert [p.finish_reason for p in phases] == ["abort"] * 3
    assert sorted(last) == [0, 1, 2] and all(idle(state) for state in last.values()), last
    decoded_on = {e.engine_index for e in events for f in e.finished if f.request_id.startswith("f")}
    assert decoded_on >= {1, 2}  # both decode instances took a share


def test_killed_decode_core_fails_the_stream_with_engine_dead_and_the_server_answers_503():
    pd = deployment(step_delay=0.02)
    decode_pid = pd.cores[1].pid

    async def main():
        gateway = Gateway(pd.cores, tiny_tokenizer(), ServerConfig(served_model_names=("fake",), shutdown_grace=0.1))
        gateway.start()
        try:
            transport = httpx.ASGITransport(app=build_app(gateway))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                body = {"prompt": "hi", "max_tokens": 120, "ignore_eos": True, "stream": True}
                streamed = asyncio.create_task(http.post("/v1/completions", json=body))
                registry, decode_tokens = gateway.metrics.registry, None
                for _ in range(1000):  # until the decode core has decoded a few tokens
                    decode_tokens = registry.get_sample_value("servelab:generation_tokens_total",
                                                              {"model_name": "fake", "engine": "1"})
                    if decode_tokens and decode_tokens >= 3:
                        break
                    await asyncio.sleep(0.01)
                os.kill(decode_pid, signal.SIGKILL)
                lines = [line for line in (await asyncio.wait_for(streamed, 20)).text.split("\n")
                         if line.startswith("data: ")]
                await asyncio.wait_for(gateway.engine.dead.wait(), 20)
                health = await http.get("/health")
                await asyncio.wait_for(gateway.wait_engine_dead(), 20)
                return lines, health
        finally:
            await gateway.stop()

    try:
        lines, health = asyncio.run(main())
    finally:
        pd.close()
    assert lines[-1] == "data: [DONE]"
    error = json.loads(lines[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_dead" and "killed by signal 9" in error["message"]
    assert health.status_code == 503
    assert all(not c.process.is_alive() for c in pd.cores)
