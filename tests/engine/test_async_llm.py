"""AsyncLLM over a real LLMEngine (stub executor): streaming, aborts, rejected adds, a failing step, stop
strings, no busy spin. The engine checks the block manager's invariants after every step."""
import asyncio
import threading

import pytest

from servelab.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from servelab.sampling_params import SamplingParams
from servelab.testing.stub_engine import VOCAB, make_engine, word_id


def run(engine, coro_fn, events=None):
    async def main():
        async_engine = AsyncLLM.in_process(engine, on_events=events.append if events is not None else None)
        async_engine.start()
        try:
            return await asyncio.wait_for(coro_fn(async_engine), timeout=20)
        finally:
            await async_engine.shutdown()

    return asyncio.run(main())


def test_streams_cumulative_outputs_from_one_engine_thread():
    engine, events = make_engine(), []

    async def body(ae):
        return [o async for o in ae.generate("r1", [1, 2, 3], SamplingParams(max_tokens=4))]

    outs = run(engine, body, events)
    # the prompt fills positions 0-2, so the stub samples w3, w4, w5, w6
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == [word_id(p) for p in (3, 4, 5, 6)]
    assert outs[-1].outputs[0].text == " w3 w4 w5 w6" and outs[-1].outputs[0].finish_reason == "length"
    assert len(engine.thread_ids) == 1 and threading.get_ident() not in engine.thread_ids
    finished = [f for e in events for f in e.finished]
    assert [f.finish_reasons for f in finished] == [["length"]]
    timing = finished[0].timings[0]
    assert timing.output_len == 4 and len(timing.token_times) == 4 and timing.ttft >= 0
    assert sum(s.num_generation_tokens for e in events for s in e.steps) == 4
    # steps the API loop had not read yet arrive coalesced, with the state after the last of them: the engine
    # may finish the request before any event is read, so only the final state is certain (all blocks back)
    states = [e.state for e in events]
    assert max(s.num_running for s in states) <= 1
    assert states[-1].num_running == 0 and states[-1].num_free_blocks == states[-1].num_blocks == 64


def test_concurrent_requests_do_not_mix():
    engine = make_engine()

    async def body(ae):
        async def one(i):
            return [o async for o in ae.generate(f"r{i}", [i + 1] * (i + 1), SamplingParams(max_tokens=3 + i))][-1]
        finals = await asyncio.gather(*(one(i) for i in range(5)))
        return finals, engine.is_idle()

    finals, idle = run(engine, body)
    assert [(f.request_id, f.outputs[0].token_ids) for f in finals] == [
        (f"r{i}", [word_id(p) for p in range(i + 1, 2 * i + 4)]) for i in range(5)]
    assert idle


def test_rejected_requests_raise_value_error_and_the_engine_keeps_serving():
    engine = make_engine(step_delay=0.02)  # "dup" runs its 127 tokens for ~2.5 s

    async def body(ae):
        with pytest.raises(ValueError, match="empty"):
            await ae.add_request("r", "", SamplingParams())
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await ae.add_request("r", [len(VOCAB)], SamplingParams())
        with pytest.raises(ValueError, match="maximum context length is 128"):
            await ae.add_request("r", [2] * 128, SamplingParams())
        running = await ae.add_request("dup", [2], SamplingParams(max_tokens=10_000))
        with pytest.raises(ValueError, match="duplicate request id"):
            await ae.add_request("dup", [2], SamplingParams(max_tokens=1))
        ae.abort("dup")
        [o async for o in running]
        return [o async for o in ae.generate("ok", "hi", SamplingParams(max_tokens=1))][-1]

    final = run(engine, body)
    assert final.finished and final.prompt_token_ids == [VOCAB.index("hi")]


def test_abort_ends_the_stream_and_frees_the_blocks():
    engine, events = make_engine(), []
    engine.executor.step_delay = 0.01

    async def body(ae):
        stream = await ae.add_request("r", [2], SamplingParams(max_tokens=10_000))  # clamped to 127
        first = await stream.__anext__()
        ae.abort("r")
        rest = [o async for o in stream]
        return first, rest, engine.get_state()

    first, rest, state = run(engine, body, events)
    assert not first.finished
    assert rest[-1].finished and rest[-1].outputs[0].finish_reason == "abort"
    total = first.copy()
    for delta in rest:  # a stream's outputs are deltas
        total.add(delta)
    assert 0 < len(total.outputs[0].token_ids) < 127
    # the abort contract: the blocks are back by the time the stream ends
    assert state.num_running == state.num_waiting == 0 and state.num_free_blocks == 64 and state.kv_usage == 0
    assert [f.finish_reasons for e in events for f in e.finished] == [["abort"]]


def test_abort_with_error_and_abort_all():
    engine = make_engine()
    engine.executor.step_delay = 0.01

    async def body(ae):
        a = await ae.add_request("a", [2], SamplingParams(max_tokens=10_000))
        b = await ae.add_request("b", [2], SamplingParams(max_tokens=10_000))
        ae.abort("a", error=RuntimeError("gateway says no"))
        with pytest.raises(RuntimeError, match="gateway says no"):
            async for _ in a:
                pass
        ae.abort_all(EngineDeadError("shutting down"))
        with pytest.raises(EngineDeadError):
            async for _ in b:
                pass
        return engine.is_idle()

    assert run(engine, body)


def test_failing_step_fails_requests_and_keeps_serving():
    engine = make_engine()
    engine.executor.step_delay = 0.01

    async def body(ae):
        stream = await ae.add_request("r", [2], SamplingParams(max_tokens=10_000))
        await stream.__anext__()
        engine.executor.fail_next_step = True
        with pytest.raises(EngineStepError, match="boom"):
            async for _ in stream:
                pass
        assert ae.is_running
        final = [o async for o in ae.generate("next", [2], SamplingParams(max_tokens=2))][-1]
        return final, engine.is_idle()

    final, idle = run(engine, body)
    assert final.finished and final.outputs[0].token_ids == [word_id(1), word_id(2)] and idle


def test_stop_string_stop_token_and_eos_end_requests_in_the_engine():
    engine = make_engine()
    engine.executor.eos_at_position = 6

    async def body(ae):
        async def final(request_id, params):
            return [o async for o in ae.generate(request_id, "hi", params)][-1].outputs[0]
        outs = await asyncio.gather(final("string", SamplingParams(max_tokens=20, stop="w3")),
                                    final("token", SamplingParams(max_tokens=20, stop_token_ids=[word_id(2)])),
                                    final("eos", SamplingParams(max_tokens=20)),
                                    final("ignore", SamplingParams(max_tokens=7, ignore_eos=True)))
        return outs, engine.is_idle()

    (string, token, eos, ignore), idle = run(engine, body)
    assert (string.text, string.finish_reason, string.stop_reason) == (" w1 w2 ", "stop", "w3")
    assert string.token_ids == [word_id(p) for p in (1, 2, 3)]
    assert (token.text, token.finish_reason, token.stop_reason) == (" w1", "stop", word_id(2))
    assert (eos.text, eos.finish_reason, eos.stop_reason) == (" w1 w2 w3 w4 w5", "stop", None)
    assert eos.token_ids[-1] == 0 and len(eos.token_ids) == 6
    assert ignore.finish_reason == "length" and ignore.token_ids[5] == 0 and len(ignore.token_ids) == 7
    assert idle  # the stop string's request was retired in the core too


def test_idle_engine_thread_sleeps():
    engine = make_engine()

    async def body(ae):
        [o async for o in ae.generate("r", [2], SamplingParams(max_tokens=2))]
        steps = engine.executor.num_steps
        await asyncio.sleep(0.3)
        return steps, engine.executor.num_steps

    before, after = run(engine, body)
    assert before == after == 2


def test_requests_after_shutdown_are_refused():
    async def main():
        ae = AsyncLLM.in_process(make_engine())
        ae.start()
        await ae.shutdown()
        with pytest.raises(EngineDeadError, match="shutting down"):
            await ae.add_request("r", [2], SamplingParams())

    asyncio.run(main())
