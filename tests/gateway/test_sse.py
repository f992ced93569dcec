"""SSE framing and the streaming response's cleanup guarantee."""
import asyncio
import json

from servelab.gateway.errors import OpenAIError
from servelab.gateway.sse import SSE_DONE, ChunkFrames, SSEResponse, sse_event


def test_event_framing():
    frame = sse_event({"a": "é", "b": [1, None]})
    assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
    assert b"\n" not in frame[:-2]
    assert json.loads(frame[len(b"data: "):-2]) == {"a": "é", "b": [1, None]}
    assert SSE_DONE == b"data: [DONE]\n\n"


def test_chunk_frames_are_the_events_sse_event_builds():
    head = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "m\u00e9"}
    choices = [{"index": 0, "text": "caf\u00e9 \"q\"\n", "logprobs": None, "finish_reason": None},
               {"index": 3, "delta": {}, "logprobs": {"token_logprobs": [-0.25, -1e-07]}, "finish_reason": "stop"}]
    for tail in ({}, {"usage": None}):
        frames = ChunkFrames(head, tail)
        for choice in choices:
            frame = frames.frame(choice)
            assert frame == sse_event({**head, "choices": [choice], **tail})
            assert frame.startswith(b"data: ") and frame.endswith(b"\n\n") and b"\n" not in frame[:-2]
            assert json.loads(frame[6:]) == {**head, "choices": [choice], **tail}
            assert list(json.loads(frame[6:])) == [*head, "choices", *tail]  # the order OpenAI's chunks have


def test_error_event_is_openai_shaped():
    frame = sse_event(OpenAIError(504, "too slow", type="timeout_error", code="request_timeout").body())
    assert json.loads(frame[6:]) == {"error": {"message": "too slow", "type": "timeout_error", "param": None,
                                               "code": "request_timeout"}}


def run_response(response, receive_messages):
    sent = []

    async def receive():
        if receive_messages:
            return receive_messages.pop(0)
        await asyncio.sleep(3600)

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"spec_version": "2.3"}}
    asyncio.run(response(scope, receive, send))
    return sent


def test_on_close_runs_after_a_full_stream():
    closed = []

    async def body():
        yield b"data: 1\n\n"
        yield SSE_DONE

    sent = run_response(SSEResponse(body(), on_close=lambda: closed.append(True)), [])
    assert [m.get("body") for m in sent[1:]] == [b"data: 1\n\n", SSE_DONE, b""]
    assert dict(sent[0]["headers"])[b"content-type"].startswith(b"text/event-stream")
    assert closed == [True]


def test_on_close_runs_when_the_client_leaves_before_the_first_chunk():
    closed, started = [], []

    async def body():
        started.append(True)
        await asyncio.sleep(3600)
        yield b"never"

    async def on_close():
        closed.append(True)

    run_response(SSEResponse(body(), on_close=on_close), [{"type": "http.disconnect"}])
    assert closed == [True]
