"""The event-loop side of one engine request: its RequestOutput deltas as an async iterator."""
from __future__ import annotations

import asyncio
from typing import Callable

from servelab.outputs import RequestOutput


class RequestStream:
    """The event-loop side of one request: an async iterator of RequestOutput deltas (what the request gained
    since the consumer last took one).

    Deltas the consumer has not taken yet are summed into one (RequestOutput.add), so a slow consumer gets
    everything in fewer, larger deltas and one output waits at most; the finished one is never skipped. All
    methods run on the event loop.

    A consumer that serves many requests (a Job) may instead set `listener`: it is called, on the loop,
    each time news arrives, and takes the news with take() -- no task and no wake-up per token."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop) -> None:
        self.request_id = request_id
        self.accepted: asyncio.Future[None] = loop.create_future()
        self.first_token_time: float | None = None
        self.done = False  # the consumer has seen the end (finished output or error)
        self.listener: Callable[[], None] | None = None  # must not raise: it runs inside the engine's dispatch
        self._unread: RequestOutput | None = None
        self._error: BaseException | None = None
        self._event = asyncio.Event()

    # ---- called by AsyncLLM on the loop (scheduled from the engine thread)
    def on_accepted(self) -> None:
        if not self.accepted.done():
            self.accepted.set_result(None)

    def on_output(self, output: RequestOutput, token_time: float | None) -> None:
        if token_time is not None and self.first_token_time is None:
            self.first_token_time = token_time
        if self._unread is None:
            self._unread = output
        else:
            self._unread.add(output)
        self._notify()

    def on_error(self, error: BaseException) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(error)
            self.accepted.exception()  # mark retrieved: a rejection awaited by nobody is not a bug
        self._error = error
        self._notify()

    def _notify(self) -> None:
        if self.listener is not None:
            self.listener()
        else:
            self._event.set()

    # ---- consumed by the request handler
    def take(self) -> RequestOutput | None:
        """What arrived since the last take (None when nothing did); raises the error once it ends in one."""
        if self._unread is not None:
            output, self._unread = self._unread, None
            if output.finished:
                self.done = True
            return output
        if self._error is not None and not self.done:
            self.done = True
            raise self._error
        return None

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        while True:
            output = self.take()
            if output is not None:
                return output
            if self.done:
                raise StopAsyncIteration
            self._event.clear()
            await self._event.wait()
