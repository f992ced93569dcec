"""StepOutputMailbox: hands an in-process engine core's EngineStepOutputs from its thread to the event loop.

The engine thread can run ahead of the event loop (a busy loop serving many clients): every step it puts
one EngineStepOutputs, and each carries a cumulative snapshot of every running request (all its token ids,
logprobs and text so far). Queued as they come, a loop that lags holds lag x requests x length of them, a
peak whose pages the allocator keeps afterwards (RSS that grows with the worst lag seen). The consumer keeps
only a request's latest snapshot anyway (RequestStream), so here a snapshot still waiting for the loop is
dropped when a newer one of the same request arrives. Kept: finished snapshots, and a request's earliest
waiting snapshot with tokens (its time may be the first token's). So at most two snapshots per request wait,
however far behind the loop is; everything else in an EngineStepOutputs (adds taken, errors, step samples,
finished records, state) is delivered in order, one item per step as before.
"""
from __future__ import annotations

import asyncio
import collections
import threading

from servelab.engine.core_protocol import EngineStepOutputs
from servelab.outputs import RequestOutput


class StepOutputMailbox:
    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: collections.deque[EngineStepOutputs | BaseException] = collections.deque()
        # request id -> (item, snapshot): its latest snapshot still waiting, if it may be dropped for a newer one
        self._droppable: dict[str, tuple[EngineStepOutputs, RequestOutput]] = {}
        self._with_tokens: set[str] = set()  # requests with a waiting snapshot that has tokens
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        """Items waiting for the loop."""
        with self._lock:
            return len(self._items)

    @property
    def num_tracked_requests(self) -> int:
        with self._lock:
            return len(self._droppable) + len(self._with_tokens)

    def put(self, item: EngineStepOutputs | BaseException) -> None:
        """Engine thread. An exception is delivered in order and raised by get()."""
        with self._lock:
            if isinstance(item, EngineStepOutputs):
                self._supersede(item)
            self._items.append(item)
            wake = len(self._items) == 1
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    def _supersede(self, item: EngineStepOutputs) -> None:
        for error in item.errors:  # it ends here: its waiting snapshot stays, nothing newer will come
            self._droppable.pop(error.request_id, None)
            self._with_tokens.discard(error.request_id)
        for output in item.outputs:
            request_id = output.request_id
            older = self._droppable.pop(request_id, None)
            if older is not None:
                outputs = older[0].outputs
                del outputs[next(i for i, o in enumerate(outputs) if o is older[1])]
            if output.finished:
                self._with_tokens.discard(request_id)
                continue
            has_tokens = any(c.token_ids for c in output.outputs)
            if has_tokens and request_id not in self._with_tokens:
                self._with_tokens.add(request_id)  # possibly its first token: kept, so its time is kept
            else:
                self._droppable[request_id] = (item, output)

    async def get(self) -> EngineStepOutputs:
        """Event loop: the oldest item waiting (raised when it is an exception)."""
        while True:
            with self._lock:
                if self._items:
                    item = self._items.popleft()
                    if not self._items:
                        self._droppable.clear()
                        self._with_tokens.clear()
                    elif isinstance(item, EngineStepOutputs):
                        self._forget(item)
                    break
                # a wake-up scheduled for an item get() took already may still come: wait past it
                self._ready.clear()
            await self._ready.wait()
        if isinstance(item, BaseException):
            raise item
        return item

    def _forget(self, item: EngineStepOutputs) -> None:
        """item leaves for the loop: the engine thread must not touch its outputs any more."""
        for output in item.outputs:
            entry = self._droppable.get(output.request_id)
            if entry is not None and entry[0] is item:
                del self._droppable[output.request_id]
