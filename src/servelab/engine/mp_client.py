"""MPClient: the API server's client of one engine-core process (see core_client.py for the interface).

The sockets live on `ipc://` paths in a fresh temp dir (never a fixed name): the API side binds the output
socket, spawns the process, and connects to the input socket that the process binds; the process builds
its engine and announces itself with EngineReady (its limits, for the input processor). Inputs go out on a PUSH socket without a high-water mark, so a send never blocks the
event loop; outputs are read on the event loop through zmq.asyncio. When nothing arrives for
DEATH_POLL_MS the process is checked: once it has exited, get_output raises EngineDeadError."""
from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import shutil
import tempfile
import time

import zmq
import zmq.asyncio

from servelab.core.engine_io import EngineCoreRequest
from servelab.engine.core_client import EngineDeadError
from servelab.engine.core_proc.core_process import EngineFactory, bound_output_socket, run_engine_core
from servelab.engine.core_proc.core_protocol import (AbortRequests, AddRequest, Codec, EngineDead, EngineReady,
                                           EngineStartupFailed, EngineStepOutputs, SendKV, Shutdown, StopRequests)

logger = logging.getLogger(__name__)

# How often the output task checks that a silent engine process is still alive.
DEATH_POLL_MS = 200
STARTUP_TIMEOUT_S = 1800.0


class MPClient:
    """One engine-core process. Construct, then wait_ready() (blocking, before the event loop runs)."""

    def __init__(self, factory: EngineFactory, engine_index: int = 0, log_level: str = "INFO") -> None:
        self.engine_index = engine_index
        self.info: EngineReady | None = None
        self._codec = Codec()
        self._dir = tempfile.mkdtemp(prefix=f"servelab-engine-{engine_index}-")
        self._context = zmq.Context()
        # The core binds the input socket and this side connects: a connecting PUSH has its pipe at once, so
        # what is sent before the core is listening waits in it instead of failing.
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never drop or block: the core drains between steps
        self._input.setsockopt(zmq.LINGER, 0)
        self._input.connect(f"ipc://{self._dir}/input")
        self._output = self._context.socket(zmq.PULL)
        self._output.setsockopt(zmq.LINGER, 0)
        bound_output_socket(self._output)  # past it the core coalesces (see core_process.py)
        self._output.bind(f"ipc://{self._dir}/output")
        self._async_output: zmq.asyncio.Socket | None = None
        self._closed = False
        self.num_kv_handoffs = 0  # see EngineCoreClient
        self.process = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, name=f"servelab-engine-core-{engine_index}",
            args=(factory, engine_index, f"ipc://{self._dir}/input", f"ipc://{self._dir}/output", os.getpid(),
                  log_level))
        self.process.start()

    @property
    def pid(self) -> int:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

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
        self.num_kv_handoffs += request.kv_transfer is not None and request.kv_transfer.do_remote_prefill

    def abort_requests(self, request_ids: list[str]) -> None:
        self._send(AbortRequests(list(request_ids)))

    def stop_requests(self, request_ids: list[str], num_output_tokens: list[int]) -> None:
        self._send(StopRequests(list(request_ids), list(num_output_tokens)))

    def send_kv(self, request_id: str, dst: int, tag: int) -> None:
        """Disaggregated prefill/decode: hand a finished prefill's KV to engine dst (see SendKV)."""
        self._send(SendKV(request_id, dst, tag))
        self.num_kv_handoffs += 1

    def _send(self, message) -> bool:
        if self._closed or not self.process.is_alive():
            return False
        try:
            self._input.send(self._codec.encode(message), zmq.NOBLOCK)
        except zmq.Again:  # cannot happen without a high-water mark; say so rather than lose the message
            logger.error("engine core %d refused a message", self.engine_index)
            return False
        return True

    async def get_output(self) -> EngineStepOutputs:
        """The next outputs; EngineDeadError once the process has exited and nothing is left to read."""
        while True:
            if await self._async_output.poll(DEATH_POLL_MS, zmq.POLLIN):
                message = self._codec.decode_output(await self._async_output.recv())
                if isinstance(message, EngineStepOutputs):
                    return message
                if isinstance(message, EngineDead):
                    raise EngineDeadError(f"engine core {self.engine_index} (pid {self.process.pid}) stopped: "
                                          f"{message.message}")
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


def launch_engine_cores(factory: EngineFactory | list[EngineFactory], num_engines: int, log_level: str = "INFO",
                        timeout: float = STARTUP_TIMEOUT_S) -> list[MPClient]:
    """Start num_engines core processes at once (core i built by factory, or by factory[i]) and wait until
    each is ready; on any failure every one started is stopped before the error propagates."""
    factories = factory if isinstance(factory, list) else [factory] * num_engines
    clients: list[MPClient] = []
    try:
        for index in range(num_engines):
            clients.append(MPClient(factories[index], index, log_level))
        for client in clients:
            client.wait_ready(timeout)
    except BaseException:
        for client in clients:
            client.close()
        raise
    return clients
