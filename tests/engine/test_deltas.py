"""Deltas across the engine core's boundary: the core sends each request's new token ids (no text, never the
output so far), the API side detokenizes them, and what waits for a reader that lags is at most one delta per
request, coalesced, with nothing lost: in-process (the outbox), over the core process's zmq socket (the busy
loop), and in a RequestStream."""
import asyncio
import os
import threading
import time

import zmq

from servelab.core.engine_io import EngineCoreTimes
from servelab.engine.async_llm import AsyncLLM
from servelab.engine.core_proc.core_loop import EngineLoop
from servelab.engine.core_proc.core_process import _busy_loop, bound_output_socket
from servelab.engine.core_proc.core_protocol import (AddRequest, Codec, EngineStepOutputs, RequestDelta, RequestError,
                                           Shutdown, coalesce)
from servelab.engine.output_processor import OutputProcessor
from servelab.metrics.events import EngineState, StepSample
from servelab.outputs import TokenLogprob
from servelab.sampling_params import SamplingParams
from servelab.testing.stub_engine import make_engine, tiny_tokenizer, word_id

STATE = EngineState(0, 0, 0.0, 8, 8, 4, 0, 4, 0)


def delta(request_id, *positions, finish=None, logprobs=False):
    lps = [TokenLogprob(word_id(p), -0.5) for p in positions] if logprobs else None
    return RequestDelta(request_id, [word_id(p) for p in positions], lps, finish, EngineCoreTimes(1.0))


def message(step, *deltas, accepted=(), errors=()):
    return EngineStepOutputs(0, STATE, float(step), accepted=list(accepted), errors=list(errors),
                             outputs=list(deltas), steps=[StepSample(0.001, len(deltas), len(deltas), 0)])


def test_coalescing_keeps_one_delta_per_request_and_everything_in_order():
    pending = message(0, delta("a", 1), accepted=["a", "b"])
    for step in range(1, 100):
        newer = [delta("a", step + 1)]
        if step < 50:
            newer.append(delta("b", step, finish="length" if step == 49 else None))
        if step == 60:  # a new request that reuses a finished one's id gets its own delta
            newer.append(delta("b", 1))
        coalesce(pending, message(step, *newer, errors=[RequestError("c", "x")] if step == 70 else []))
    assert [(d.request_id, d.new_token_ids[:2], len(d.new_token_ids), d.finish_reason) for d in pending.outputs] == [
        ("a", [word_id(1), word_id(2)], 100, None), ("b", [word_id(1), word_id(2)], 49, "length"),
        ("b", [word_id(1)], 1, None)]
    assert pending.outputs[0].new_token_ids == [word_id(p) for p in range(1, 101)]
    assert len(pending.steps) == 100 and pending.output_time == 99.0 and pending.accepted == ["a", "b"]
    assert [e.request_id for e in pending.errors] == ["c"]


def test_a_coalesced_delta_is_cut_at_the_stop_string_and_deltas_sum_to_the_whole():
    request = make_engine().input_processor.process_inputs("r", "hi", SamplingParams(max_tokens=20, stop="w3",
                                                                                     logprobs=0))
    whole, parts = OutputProcessor(tiny_tokenizer(), cumulative=True), OutputProcessor(tiny_tokenizer())
    for processor in (whole, parts):
        processor.add_request(request, [request])
    first = parts.process([delta("r", 1, logprobs=True)])
    # the core sampled w2..w5 before it heard of the stop; w4 and w5 are dropped
    rest = parts.process([delta("r", 2, 3, 4, 5, logprobs=True)])
    assert rest.stopped_request_ids == ["r"] and rest.stopped_num_tokens == [3]
    total = first.request_outputs[0].copy()
    total.add(rest.request_outputs[0])
    c = total.outputs[0]
    assert (c.text, c.token_ids, c.finish_reason, c.stop_reason) == (" w1 w2 ", [word_id(p) for p in (1, 2, 3)],
                                                                     "stop", "w3")
    assert [lp.token_id for lp in c.logprobs] == c.token_ids and c.cumulative_logprob == -1.5
    cumulative = whole.process([delta("r", 1, 2, 3, 4, 5, logprobs=True)]).request_outputs[0]
    assert cumulative.outputs[0].text == c.text and cumulative.outputs[0].token_ids == c.token_ids


def test_a_lagging_event_loop_holds_one_delta_per_request_in_process():
    engine = make_engine(num_blocks=128)
    lengths = {"a": 40, "b": 60, "c": 100}

    async def main():
        ae = AsyncLLM.in_process(engine)
        ae.start()
        try:
            streams = {r: ae.submit(ae.input_processor.process_inputs(r, [2], SamplingParams(max_tokens=n,
                                                                                             ignore_eos=True)))
                       for r, n in lengths.items()}
            while engine.has_unfinished_requests() or not engine.executor.plans:  # the loop is blocked meanwhile
                time.sleep(0.001)
            pending = ae.cores[0]._outputs.pending
            assert [(d.request_id, len(d.new_token_ids), d.finish_reason) for d in pending.outputs] == [
                ("a", 40, "length"), ("b", 60, "length"), ("c", 100, "length")]
            assert len(pending.steps) == len(engine.executor.plans)
            outputs = {r: [o async for o in s] for r, s in streams.items()}
        finally:
            await ae.shutdown()
        return outputs

    outputs = asyncio.run(main())
    for request_id, n in lengths.items():
        [only] = outputs[request_id]  # one delta, coalesced, with the whole text
        assert only.finished and only.outputs[0].token_ids == [word_id(p) for p in range(1, n + 1)]
        assert only.outputs[0].text == "".join(f" w{p % 32}" for p in range(1, n + 1))


def test_the_core_process_loop_coalesces_when_the_api_server_does_not_read(tmp_path):
    engine = make_engine(num_blocks=512, max_num_seqs=16)
    request_ids = [f"r{i}" for i in range(16)]
    loop, codec, context = EngineLoop(engine), Codec(), zmq.Context()
    core_in, api_out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    core_out, api_in = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    core_in.bind(f"ipc://{tmp_path}/in")
    api_out.connect(f"ipc://{tmp_path}/in")
    for socket in (core_out, api_in):
        # a small kernel buffer: with zmq's own batches the socket holds a few dozen of these messages, not 100
        bound_output_socket(socket, buffer_bytes=4096)
    api_in.bind(f"ipc://{tmp_path}/out")
    core_out.connect(f"ipc://{tmp_path}/out")
    thread = threading.Thread(target=_busy_loop, args=(loop, core_in, core_out, codec, os.getppid()), daemon=True)
    thread.start()
    try:
        for request_id in request_ids:
            request = engine.input_processor.process_inputs(request_id, [2], SamplingParams(max_tokens=100,
                                                                                            ignore_eos=True))
            api_out.send(codec.encode(AddRequest(request)))
        while engine.has_unfinished_requests() or len(engine.executor.plans) < 100:  # nobody reads meanwhile
            time.sleep(0.001)
        messages, tokens, finished = [], {r: [] for r in request_ids}, set()
        while len(finished) < len(request_ids):
            assert api_in.poll(10_000)
            messages.append(codec.decode_output(api_in.recv()))
            ids = [d.request_id for d in messages[-1].outputs]
            assert len(ids) == len(set(ids))
            for d in messages[-1].outputs:
                tokens[d.request_id] += d.new_token_ids
                if d.finish_reason is not None:
                    finished.add(d.request_id)
        api_out.send(codec.encode(Shutdown()))
        thread.join(10)
    finally:
        for socket in (core_in, api_out, core_out, api_in):
            socket.close(linger=0)
        context.term()
    assert all(t == [word_id(p) for p in range(1, 101)] for t in tokens.values())
    num_steps = len(engine.executor.plans)
    assert sum(len(m.steps) for m in messages) == num_steps and len(messages) < num_steps
