"""Server-sent events as OpenAI frames them: `data: {json}\n\n` per chunk, `data: [DONE]\n\n` last."""
from __future__ import annotations

import json
from typing import AsyncIterable, Awaitable, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

SSE_DONE = b"data: [DONE]\n\n"
SSE_HEADERS = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}


def sse_event(data: dict) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


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
