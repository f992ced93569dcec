"""The API server's handle on one engine core, in two runners with one interface (vLLM's core_client):

- MPClient (mp_client.py): the core runs in its own process (core_process.py); inputs go out on a PUSH
  socket, outputs come back on a PULL socket read by an asyncio task (zmq.asyncio), so model steps never
  hold the API server's GIL. The process is watched: when it exits unasked, get_output raises
  EngineDeadError.
- InprocClient: the same EngineLoop in a thread of the API process (`--engine-in-process`, tests); its
  outputs reach the event loop through an OutputOutbox: one message waits at most, and the iterations the
  event loop has not taken yet are coalesced into it (one delta per request), so memory stays bounded when
  the event loop lags.

Both: start() on the event loop, then add_request / abort_requests / stop_requests (non-blocking, in order), await
get_output() for each EngineStepOutputs, and await shutdown() (bounded; a process that does not stop in
time is killed)."""
from __future__ import annotations

import asyncio
import logging
import os
import threading
from typing import TYPE_CHECKING, Protocol

from servelab.core.engine_io import EngineCoreRequest
from servelab.engine.core_proc.core_loop import EngineLoop
from servelab.engine.core_proc.core_protocol import (AbortRequests, AddRequest, EngineReady, EngineStepOutputs, SendKV,
                                           StopRequests, coalesce)

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in the engine were failed."""


class EngineDeadError(RuntimeError):
    """The engine core has stopped; no request can be served."""


class EngineCoreClient(Protocol):
    info: EngineReady
    # KV handoffs ordered through this client: sends (prefill side) plus prefilled requests added (decode side)
    num_kv_handoffs: int

    def start(self) -> None: ...

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    def stop_requests(self, request_ids: list[str], num_output_tokens: list[int]) -> None:
        """Retire engine-core requests whose stop string the output processor matched (see StopRequests)."""

    def send_kv(self, request_id: str, dst: int, tag: int) -> None:
        """Disaggregated prefill/decode: send a finished prefill's held KV blocks to engine dst."""

    async def get_output(self) -> EngineStepOutputs: ...

    async def shutdown(self, timeout: float) -> None: ...

    def close(self) -> None:
        """Blocking, idempotent: stop now whatever still runs (the last resort on the way out)."""

    def is_alive(self) -> bool:
        """The core can still take requests."""


class OutputOutbox:
    """Hands an in-process core's EngineStepOutputs from its thread to the event loop. At most one message
    waits: what the thread puts while the loop has not taken the last one is coalesced into it."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: EngineStepOutputs | None = None
        self._error: BaseException | None = None
        self._ready = asyncio.Event()

    @property
    def pending(self) -> EngineStepOutputs | None:
        return self._pending

    def put(self, item: EngineStepOutputs | BaseException) -> None:
        """Engine thread. An exception ends the outputs: get() raises it after the last message."""
        with self._lock:
            wake = self._pending is None and self._error is None
            if isinstance(item, BaseException):
                self._error = item
            elif self._pending is None:
                self._pending = item
            else:
                coalesce(self._pending, item)
        if wake:
            try:
                self._loop.call_soon_threadsafe(self._ready.set)
            except RuntimeError:  # the event loop is closed: nobody is listening any more
                pass

    async def get(self) -> EngineStepOutputs:
        """Event loop: the waiting message (raised when the outputs ended in an exception)."""
        while True:
            with self._lock:
                item, self._pending = self._pending, None
                if item is None and self._error is not None:
                    raise self._error
                if item is not None:
                    return item
                # a wake-up scheduled for a message get() took already may still come: wait past it
                self._ready.clear()
            await self._ready.wait()


class InprocClient:
    def __init__(self, engine: "LLMEngine", engine_index: int = 0) -> None:
        self.engine = engine
        self._engine_loop = EngineLoop(engine, engine_index)
        self.info = self._engine_loop.ready(os.getpid())
        self._cond = threading.Condition()
        self._inbox: list[AddRequest | AbortRequests | StopRequests | SendKV] = []
        self._stopping = False
        self._closed_error: EngineDeadError | None = None
        self._outputs: OutputOutbox | None = None
        self._thread: threading.Thread | None = None
        self.num_kv_handoffs = 0

    def start(self) -> None:
        self._outputs = OutputOutbox(asyncio.get_running_loop())
        self._thread = threading.Thread(target=self._run, name=f"servelab-engine-{self.info.engine_index}",
                                        daemon=True)
        self._thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._post(AddRequest(request), refuse=True)
        self.num_kv_handoffs += request.kv_transfer is not None and request.kv_transfer.do_remote_prefill

    def abort_requests(self, request_ids: list[str]) -> None:
        self._post(AbortRequests(list(request_ids)), refuse=False)

    def stop_requests(self, request_ids: list[str], num_output_tokens: list[int]) -> None:
        self._post(StopRequests(list(request_ids), list(num_output_tokens)), refuse=False)

    def send_kv(self, request_id: str, dst: int, tag: int) -> None:
        self._post(SendKV(request_id, dst, tag), refuse=False)
        self.num_kv_handoffs += 1

    async def get_output(self) -> EngineStepOutputs:
        return await self._outputs.get()

    async def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    def is_alive(self) -> bool:
        with self._cond:
            return self._closed_error is None and self._thread is not None and self._thread.is_alive()

    def close(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()

    def _post(self, message: AddRequest | AbortRequests | StopRequests | SendKV, refuse: bool) -> None:
        with self._cond:
            if self._closed_error is not None or self._thread is None:
                if refuse:
                    raise self._closed_error or EngineDeadError("the engine core is not started")
                return
            self._inbox.append(message)
            self._cond.notify()

    def _run(self) -> None:
        engine_loop = self._engine_loop
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._stopping and not engine_loop.has_work():
                        if engine_loop.has_pending_kv():  # transfers finish on their own threads
                            self._cond.wait(0.001)
                            break
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    if self._stopping:
                        break
                result = engine_loop.run_once(inbox)
                if result is not None:
                    self._outputs.put(result)
            error = EngineDeadError("the engine core has shut down")
        except BaseException as exc:  # the loop itself broke
            logger.exception("engine core %d died", self.info.engine_index)
            error = EngineDeadError(f"engine core {self.info.engine_index} died: {type(exc).__name__}: {exc}")
        with self._cond:
            self._closed_error = error
        self._outputs.put(error)
