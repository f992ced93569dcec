"""Server-sent events as OpenAI frames them: `data: {json}\n\n` per chunk, `data: [DONE]\n\n` last."""
from __future__ import annotations

from typing import AsyncIterable, Awaitable, Callable

import msgspec
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


_encode = msgspec.json.Encoder().encode  # compact UTF-8 JSON, as json.dumps(ensure_ascii=False) writes it


def sse_event(data: dict) -> bytes:
    return b"data: " + _encode(data) + b"\n\n"


class ChunkFrames:
    """The events of one stream: every chunk has the same fields around `choices` (id, object, created,
    model; `usage: null` when the client asked for usage), so those bytes are encoded once and each event
    encodes only its choice (as vLLM does). frame(choice) == sse_event({**head, "choices": [choice], **tail})."""

    def __init__(self, head: dict, tail: dict) -> None:
        self.head = head
        self._prefix = b"data: " + _encode(head)[:-1] + b',"choices":['
        self._suffix = b"]" + (b"," + _encode(tail)[1:-1] if tail else b"") + b"}\n\n"

    def frame(self, choice: dict) -> bytes:
        return self._prefix + _encode(choice) + self._suffix


class SSEResponse(StreamingResponse):
    """A streaming response whose on_close runs however the stream ends, including when the client
    went away before the first byte (an async generator that never started has no finally to run)."""

    def __init__(self, content: AsyncIterable[bytes], on_close: Callable[[], Awaitable[None] | None],
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(content, media_type="text/event-stream", headers={**SSE_HEADERS, **(headers or {})})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            result = self._on_close()
            if result is not None:
                await result
