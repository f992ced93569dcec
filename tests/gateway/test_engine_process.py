"""Engine cores in their own processes (spawned, stub executor, real LLMEngine): the same requests give the
same outputs as the in-process thread; a core killed with SIGKILL fails what was in flight and the
server answers 503; two data-parallel cores share the load and free every KV block; no process is left."""
import asyncio
import json
import multiprocessing
import os
import random
import signal

import httpx
import pytest

from servelab.engine.core_client import InprocClient
from servelab.engine.mp_client import launch_engine_cores
from servelab.engine.core_proc.core_process import EngineFactory
from servelab.gateway.app import Gateway, build_app
from servelab.engine.async_llm import AsyncLLM
from servelab.gateway.config import ServerConfig
from servelab.engine.engine_loads import EngineLoads
from servelab.metrics.events import EngineState
from servelab.sampling_params import SamplingParams
from servelab.testing.stub_engine import VOCAB, make_engine, tiny_tokenizer, word_id

HELLO = VOCAB.index("hello")
# eos at context length 9; a step that computes "hello" fails (once)
ENGINE_OPTIONS = dict(eos_at_position=9, fail_on_token_id=HELLO, step_delay=0.002)


def process_cores(num_engines: int = 1, **options):
    return launch_engine_cores(EngineFactory(make_engine, kwargs=options), num_engines, timeout=120)


def alive(pid: int) -> bool:
    """Running, not a zombie (/proc: no psutil needed)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


async def scenario(ae: AsyncLLM) -> list:
    """The requests both runners get; returns comparable results (no times)."""
    async def final(request_id, prompt, params):
        try:
            out = [o async for o in ae.generate(request_id, prompt, params)][-1]
        except Exception as exc:
            return request_id, type(exc).__name__, str(exc)
        return request_id, [(c.index, c.token_ids, c.text, c.finish_reason, c.stop_reason) for c in out.outputs]

    results = list(await asyncio.gather(
        *(final(f"c{i}", [word_id(i)] * (i + 1), SamplingParams(max_tokens=3 + i)) for i in range(5)),
        final("string", "hi", SamplingParams(max_tokens=20, stop="w3")),
        final("token", "hi", SamplingParams(max_tokens=20, stop_token_ids=[word_id(2)])),
        final("eos", "hi", SamplingParams(max_tokens=20)),
        final("ignore", "hi", SamplingParams(max_tokens=12, ignore_eos=True)),
        final("n2", "hi", SamplingParams(max_tokens=4, n=2, temperature=1.0, seed=5)),
        final("long", [2] * 40, SamplingParams(max_tokens=3))))
    results.append(await final("bad", [len(VOCAB)], SamplingParams()))
    stream = await ae.add_request("aborted", [2], SamplingParams(max_tokens=10_000, ignore_eos=True))
    first = await stream.__anext__()
    ae.abort("aborted")
    total = first.copy()
    async for delta in stream:  # a stream's outputs are deltas
        total.add(delta)
    last = total.outputs[0]
    expected = [word_id(p) for p in range(1, 1 + len(last.token_ids))]
    results.append(("aborted", first.finished, last.finish_reason, last.token_ids == expected))
    results.append(await final("fails", "hello hi", SamplingParams(max_tokens=3)))  # the failing step
    results.append(await final("after", "hi hi", SamplingParams(max_tokens=2)))
    return results


def run(cores, body, tokenizer=None, events=None):
    async def main():
        ae = AsyncLLM(cores, tokenizer or tiny_tokenizer(), on_events=events.append if events is not None else None)
        ae.start()
        try:
            return await asyncio.wait_for(body(ae), timeout=60)
        finally:
            await ae.shutdown()

    return asyncio.run(main())


def idle(state: EngineState) -> bool:
    return state.num_running == state.num_waiting == 0 and state.num_free_blocks == state.num_blocks


def test_engine_core_process_gives_the_same_outputs_as_the_thread():
    thread_events, process_events = [], []
    in_thread = run([InprocClient(make_engine(**ENGINE_OPTIONS))], scenario, events=thread_events)
    cores = process_cores(**ENGINE_OPTIONS)
    pid = cores[0].pid
    assert pid != os.getpid() and alive(pid)
    in_process = run(cores, scenario, events=process_events)
    assert in_process == in_thread
    by_id = {r[0]: r[1:] for r in in_process}
    assert by_id["c0"] == ([(0, [word_id(1), word_id(2), word_id(3)], " w1 w2 w3", "length", None)],)
    assert by_id["eos"] == ([(0, [word_id(p) for p in range(1, 9)] + [0], " w1 w2 w3 w4 w5 w6 w7 w8", "stop",
                              None)],)
    assert by_id["string"][0][0][2:] == (" w1 w2 ", "stop", "w3")
    assert by_id["bad"][0] == "ValueError" and "outside the vocabulary" in by_id["bad"][1]
    assert by_id["aborted"] == (False, "abort", True)
    assert by_id["fails"] == ("EngineStepError", "the engine step failed: RuntimeError: boom")
    assert by_id["after"][0][0][3] == "length"
    assert idle(process_events[-1].state) and idle(thread_events[-1].state)
    # metrics see the same requests finish, with the same reasons
    reasons = lambda events: sorted((f.request_id, tuple(f.finish_reasons)) for e in events for f in e.finished)
    assert reasons(process_events) == reasons(thread_events)
    assert cores[0].process.exitcode == 0 and not alive(pid)


def test_killed_engine_core_fails_the_stream_and_the_server_answers_503():
    cores = process_cores(step_delay=0.02)
    pid = cores[0].pid

    async def main():
        gateway = Gateway(cores, tiny_tokenizer(), ServerConfig(served_model_names=("fake",), shutdown_grace=0.1))
        gateway.start()
        try:
            transport = httpx.ASGITransport(app=build_app(gateway))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as http:
                body = {"prompt": "hi", "max_tokens": 120, "ignore_eos": True}
                streamed = asyncio.create_task(http.post("/v1/completions", json={**body, "stream": True}))
                plain = asyncio.create_task(http.post("/v1/completions", json=body))
                for _ in range(1000):  # until both have their first token
                    if gateway.admission.num_in_flight == 2 and gateway.admission.num_queued == 0:
                        break
                    await asyncio.sleep(0.01)
                os.kill(pid, signal.SIGKILL)
                responses = await asyncio.wait_for(asyncio.gather(streamed, plain), 20)
                await asyncio.wait_for(gateway.engine.dead.wait(), 20)
                after = (await http.get("/health"), await http.post("/v1/completions", json=body))
                await asyncio.wait_for(gateway.wait_engine_dead(), 20)
                return responses, after
        finally:
            await gateway.stop()

    (streamed, plain), (health, late) = asyncio.run(main())
    payloads = streamed.text[:-2].split("\n\n")
    assert payloads[-1] == "data: [DONE]"
    error = json.loads(payloads[-2].removeprefix("data: "))["error"]
    assert error["code"] == "engine_dead" and "killed by signal 9" in error["message"]
    assert len(payloads) > 2  # tokens came before the error
    assert plain.status_code == 503 and plain.json()["error"]["code"] == "engine_dead"
    assert health.status_code == 503 and "killed by signal 9" in health.json()["error"]["message"]
    assert late.status_code == 503 and late.json()["error"]["code"] == "engine_dead"
    assert not alive(pid)


def test_data_parallel_cores_share_the_load_and_free_every_block():
    cores = process_cores(2, step_delay=0.002)
    pids = [core.pid for core in cores]
    events = []

    async def body(ae: AsyncLLM):
        async def final(i):
            return [o async for o in ae.generate(f"r{i}", [i % 3 + 1] * 3, SamplingParams(max_tokens=8))][-1]

        finals = await asyncio.gather(*(final(i) for i in range(16)))
        rng = random.Random(0)

        async def maybe_abandoned(i):
            stream = await ae.add_request(f"f{i}", [2] * (1 + i % 5), SamplingParams(max_tokens=60))
            leave_after = rng.choice([0, 1, 3, None])
            seen = 0
            async for _ in stream:
                seen += 1
                if seen == leave_after:
                    ae.abort(f"f{i}")
            return leave_after

        await asyncio.gather(*(maybe_abandoned(i) for i in range(40)))
        return finals

    finals = run(cores, body, events=events)
    assert len(set(pids)) == 2 and os.getpid() not in pids
    assert all(f.outputs[0].token_ids == [word_id(p) for p in range(3, 11)] for f in finals)
    served = {e.engine_index: set() for e in events}
    for e in events:
        served[e.engine_index] |= {f.request_id for f in e.finished}
    assert set(served) == {0, 1} and all(len(ids) >= 10 for ids in served.values())
    assert not served[0] & served[1]
    last = {e.engine_index: e.state for e in events}
    assert all(idle(state) for state in last.values())
    assert [core.process.exitcode for core in cores] == [0, 0] and not any(alive(pid) for pid in pids)


def test_engine_loads_pick_the_least_loaded_ties_to_the_lowest_index():
    loads = EngineLoads(3)
    assert loads.pick() == 0
    loads.sent(0, 2)
    assert loads.pick() == 1
    loads.sent(1, 1)
    loads.sent(2, 1)
    assert loads.pick() == 1
    loads.answered(0, 2)
    loads.report(0, EngineState(1, 1, 0.0, 8, 8, 4, 0, 4, 0))
    assert [loads.load(i) for i in range(3)] == [2, 1, 1] and loads.pick() == 1



def test_a_core_that_cannot_start_says_why_and_no_process_is_left():
    with pytest.raises(RuntimeError, match="engine core 0 could not start: TypeError: .*no_such_option"):
        launch_engine_cores(EngineFactory(make_engine, kwargs={"no_such_option": 1}), 1, timeout=120)
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("servelab-engine-core")]
