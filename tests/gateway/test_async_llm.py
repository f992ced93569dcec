"""AsyncLLM against a scripted engine: streaming, aborts, rejected adds, a failing step, no busy spin."""
import asyncio
import threading

import pytest

from fakes import FakeEngine
from servelab.gateway.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from servelab.sampling_params import SamplingParams


def run(engine, coro_fn, events=None):
    async def main():
        async_engine = AsyncLLM(engine, on_events=events.append if events is not None else None)
        async_engine.start()
        try:
            return await asyncio.wait_for(coro_fn(async_engine), timeout=20)
        finally:
            async_engine.shutdown()

    return asyncio.run(main())


def test_streams_cumulative_outputs_from_one_engine_thread():
    engine, events = FakeEngine(), []

    async def body(ae):
        outs = [o async for o in ae.generate("r1", [1, 2, 3], SamplingParams(max_tokens=4))]
        return outs

    outs = run(engine, body, events)
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [0, 1, 2, 3]
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
    finished = [f for e in events for f in e.finished]
    assert [f.finish_reasons for f in finished] == [["length"]]
    timing = finished[0].timings[0]
    assert timing.output_len == 4 and len(timing.token_times) == 4 and timing.ttft >= 0
    assert sum(e.step.num_generation_tokens for e in events if e.step) == 4


def test_concurrent_requests_do_not_mix():
    engine = FakeEngine()

    async def body(ae):
        async def one(i):
            return [o async for o in ae.generate(f"r{i}", [i], SamplingParams(max_tokens=3 + i))][-1]
        return await asyncio.gather(*(one(i) for i in range(5)))

    finals = run(engine, body)
    assert [(f.request_id, len(f.outputs[0].token_ids)) for f in finals] == [(f"r{i}", 3 + i) for i in range(5)]


def test_rejected_request_raises_value_error():
    async def body(ae):
        with pytest.raises(ValueError, match="bad prompt"):
            await ae.add_request("r", "bad", SamplingParams())
        return [o async for o in ae.generate("ok", [1], SamplingParams(max_tokens=1))][-1].finished

    assert run(FakeEngine(), body)


def test_abort_ends_the_stream_and_leaves_the_engine():
    engine, events = FakeEngine(), []
    engine.step_delay = 0.01

    async def body(ae):
        stream = await ae.add_request("r", [1], SamplingParams(max_tokens=10_000))
        first = await stream.__anext__()
        ae.abort("r")
        rest = [o async for o in stream]
        return first, rest

    first, rest = run(engine, body, events)
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    assert engine.requests == {}
    assert events[-1].state.num_free_blocks == 10 and events[-1].state.kv_usage == 0


def test_abort_with_error_and_abort_all():
    engine = FakeEngine()
    engine.step_delay = 0.01

    async def body(ae):
        a = await ae.add_request("a", [1], SamplingParams(max_tokens=10_000))
        b = await ae.add_request("b", [1], SamplingParams(max_tokens=10_000))
        ae.abort("a", error=RuntimeError("gateway says no"))
        with pytest.raises(RuntimeError, match="gateway says no"):
            async for _ in a:
                pass
        ae.abort_all(EngineDeadError("shutting down"))
        with pytest.raises(EngineDeadError):
            async for _ in b:
                pass
        return engine.requests

    assert run(engine, body) == {}


def test_failing_step_fails_requests_and_keeps_serving():
    engine = FakeEngine()
    engine.step_delay = 0.01

    async def body(ae):
        stream = await ae.add_request("r", [1], SamplingParams(max_tokens=10_000))
        engine.fail_next_step = True
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in stream:
                pass
        assert ae.is_running
        return [o async for o in ae.generate("next", [1], SamplingParams(max_tokens=2))][-1]

    final = run(engine, body)
    assert final.finished and engine.requests == {}


def test_idle_engine_thread_sleeps():
    engine = FakeEngine()

    async def body(ae):
        [o async for o in ae.generate("r", [1], SamplingParams(max_tokens=2))]
        steps = engine.num_steps
        await asyncio.sleep(0.3)
        return steps, engine.num_steps

    before, after = run(engine, body)
    assert before == after == 2


def test_requests_after_shutdown_are_refused():
    async def main():
        ae = AsyncLLM(FakeEngine())
        ae.start()
        ae.shutdown()
        with pytest.raises(EngineDeadError):
            await ae.add_request("r", [1], SamplingParams())

    asyncio.run(main())
