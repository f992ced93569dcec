"""The API server's handle on one engine core, in two runners with one interface (vLLM's core_client):

- MPClient: the core runs in its own process (core_process.py); inputs go out on a PUSH socket, outputs
  come back on a PULL socket read by an asyncio task (zmq.asyncio), so model steps never hold the API
  server's GIL. The process is watched: when it exits unasked, get_output raises EngineDeadError.
- InprocClient: the same EngineLoop in a thread of the API process (`--engine-in-process`, tests).

Both: start() on the event loop, then add_request / abort_requests (non-blocking, in order), await
get_output() for each EngineStepOutputs, and await shutdown() (bounded; a process that does not stop in
time is killed)."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import threading
import time
from typing import TYPE_CHECKING, Protocol

import zmq
import zmq.asyncio

from servelab.core.messages import EngineCoreRequest
from servelab.engine.core_loop import EngineLoop
from servelab.engine.core_process import EngineFactory, run_engine_core
from servelab.engine.core_protocol import (AbortRequests, AddRequest, Codec, EngineReady, EngineStartupFailed,
                                           EngineStepOutputs, Shutdown)

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# How often the output task checks that a silent engine process is still alive.
DEATH_POLL_MS = 200
STARTUP_TIMEOUT_S = 1800.0


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in the engine were failed."""


class EngineDeadError(RuntimeError):
    """The engine core has stopped; no request can be served."""


class EngineCoreClient(Protocol):
    info: EngineReady

    def start(self) -> None: ...

    def add_request(self, request: EngineCoreRequest) -> None: ...

    def abort_requests(self, request_ids: list[str]) -> None: ...

    async def get_output(self) -> EngineStepOutputs: ...

    async def shutdown(self, timeout: float) -> None: ...


class InprocClient:
    def __init__(self, engine: "LLMEngine", engine_index: int = 0) -> None:
        self.engine = engine
        self._engine_loop = EngineLoop(engine, engine_index)
        self.info = self._engine_loop.ready(os.getpid())
        self._cond = threading.Condition()
        self._inbox: list[AddRequest | AbortRequests] = []
        self._stopping = False
        self._closed_error: EngineDeadError | None = None
        self._outputs: asyncio.Queue[EngineStepOutputs | EngineDeadError] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._outputs = asyncio.Queue()
        self._thread = threading.Thread(target=self._run, name=f"servelab-engine-{self.info.engine_index}",
                                        daemon=True)
        self._thread.start()

    def add_request(self, request: EngineCoreRequest) -> None:
        self._post(AddRequest(request), refuse=True)

    def abort_requests(self, request_ids: list[str]) -> None:
        self._post(AbortRequests(list(request_ids)), refuse=False)

    async def get_output(self) -> EngineStepOutputs:
        item = await self._outputs.get()
        if isinstance(item, EngineDeadError):
            raise item
        return item

    async def shutdown(self, timeout: float = 10.0) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout)

    def _post(self, message: AddRequest | AbortRequests, refuse: bool) -> None:
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
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    if self._stopping:
                        break
                result = engine_loop.run_once(inbox)
                if result is not None:
                    self._deliver(result)
            error = EngineDeadError("the engine core has shut down")
        except BaseException as exc:  # the loop itself broke
            logger.exception("engine core %d died", self.info.engine_index)
            error = EngineDeadError(f"engine core {self.info.engine_index} died: {type(exc).__name__}: {exc}")
        with self._cond:
            self._closed_error = error
        self._deliver(error)

    def _deliver(self, item: EngineStepOutputs | EngineDeadError) -> None:
        try:
            self._loop.call_soon_threadsafe(self._outputs.put_nowait, item)
        except RuntimeError:  # the event loop is closed: nobody is listening any more
            pass


class MPClient:
    """One engine-core process. Construct, then wait_ready() (blocking, before the event loop runs)."""

    def __init__(self, factory: EngineFactory, engine_index: int = 0, log_level: str = "INFO") -> None:
        self.engine_index = engine_index
        self.info: EngineReady | None = None
        self._codec = Codec()
        self._dir = tempfile.mkdtemp(prefix=f"servelab-engine-{engine_index}-")
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the core drains between steps
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.bind(f"ipc://{self._dir}/input")
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        self._output.bind(f"ipc://{self._dir}/output")
        self._async_output: zmq.asyncio.Socket | None = None
        self._closed = False
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name=f"servelab-engine-core-{engine_index}",
            args=(factory, engine_index, f"ipc://{self._dir}/input", f"ipc://{self._dir}/output", os.getpid(),
                  log_level))
        self.process.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> EngineReady:
        """Blocks until the core announced itself. RuntimeError when it failed or exited while starting."""
        deadline = time.monotonic() + timeout
        while self.info is None:
            if self._output.poll(DEATH_POLL_MS):
                message = self._codec.decode_output(self._output.recv())
                if isinstance(message, EngineStartupFailed):
                    raise RuntimeError(f"engine core {self.engine_index} could not start: {message.message}")
                if isinstance(message, EngineReady):
                    self.info = message
            elif not self.process.is_alive():
                raise RuntimeError(f"engine core {self.engine_index} exited with code {self.process.exitcode} "
                                   "while starting")
            elif time.monotonic() > deadline:
                raise RuntimeError(f"engine core {self.engine_index} not ready after {timeout:g} s")
        return self.info

    def start(self) -> None:
        self._async_output = zmq.asyncio.Socket.from_socket(self._output)

    def add_request(self, request: EngineCoreRequest) -> None:
        if not self._send(AddRequest(request)):
            raise EngineDeadError(self.death_message())

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(list(request_ids)))

    def _send(self, message) -> bool:
        if self._closed or not self.process.is_alive():
            return False
        try:
            self._input.send(self._codec.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # no peer: the core is gone
            return False
        return True

    async def get_output(self) -> EngineStepOutputs:
        """The next outputs; EngineDeadError once the process has exited and nothing is left to read."""
        while True:
            if await self._async_output.poll(DEATH_POLL_MS, zmq.POLLIN):
                message = self._codec.decode_output(await self._async_output.recv())
                if isinstance(message, EngineStepOutputs):
                    return message
                logger.warning("engine core %d sent an unexpected %s", self.engine_index, type(message).__name__)
            elif not self.process.is_alive():
                raise EngineDeadError(self.death_message())

    def death_message(self) -> str:
        code = self.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit code {code}"
        return f"engine core {self.engine_index} (pid {self.process.pid}) died ({how})"

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, wait for it (bounded), kill it if needed."""
        self._send(Shutdown())
        await asyncio.to_thread(self.process.join, timeout)
        self.close()

    def close(self) -> None:
        """Stop the process now if it still runs (terminate, then kill) and release the sockets."""
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5.0)
        if self._closed:
            return
        self._closed = True
        if self._async_output is not None:
            self._async_output.close(linger=0)  # closes the socket it shadows too
        self._context.destroy(linger=0)
        shutil.rmtree(self._dir, ignore_errors=True)


def launch_engine_cores(factory: EngineFactory, num_engines: int, log_level: str = "INFO",
                        timeout: float = STARTUP_TIMEOUT_S) -> list[MPClient]:
    """Start num_engines core processes at once and wait until each is ready; on any failure every one
    started is stopped before the error propagates."""
    clients: list[MPClient] = []
    try:
        for index in range(num_engines):
            clients.append(MPClient(factory, index, log_level))
        for client in clients:
            client.wait_ready(timeout)
    except BaseException:
        for client in clients:
            client.close()
        raise
    return clients
