"""The engine-core process: builds an LLMEngine from a picklable recipe and runs EngineLoop on two zmq
sockets (PULL, bound: inputs from the API server; PUSH, connected: outputs to it). Started with `spawn`, so
nothing of the API process (threads, sockets, the event loop) is inherited; not a daemon, so it may start
processes of its own (tensor-parallel workers).

The output socket holds at most OUTPUT_HWM messages on each end and OUTPUT_BUFFER_BYTES in the kernel
(bound_output_socket). When the API server falls that far behind,
the loop does not wait and does not queue more messages: it keeps stepping and folds each iteration's outputs
into the one message still to leave (core_protocol.coalesce), so what waits for a lagging API server is at most
one delta per request, whatever the lag."""
from __future__ import annotations

import logging
import os
import signal
import sys
from dataclasses import dataclass, field
from typing import Callable

from typing import TYPE_CHECKING

import zmq

from servelab.engine.core_proc.core_loop import EngineLoop
from servelab.engine.core_proc.core_protocol import Codec, EngineDead, EngineStartupFailed, EngineStepOutputs, Shutdown, coalesce
from servelab.errors import ExecutorDeadError

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine
    from servelab.engine_args import EngineArgs

logger = logging.getLogger(__name__)

# While idle the loop wakes this often to notice that the API server is gone (it then exits).
IDLE_POLL_MS = 500
# While only KV transfers are under way (on their own threads), how often the loop looks for finished ones.
KV_POLL_MS = 1
# On Shutdown, how long the last outputs may take to leave before the socket is dropped.
OUTPUT_LINGER_MS = 1000
# Messages the output socket queues on each end, and bytes in the kernel, before the loop coalesces instead
# (see the module docstring).
OUTPUT_HWM = 4
OUTPUT_BUFFER_BYTES = 1 << 16


def bound_output_socket(socket: zmq.Socket, buffer_bytes: int = OUTPUT_BUFFER_BYTES) -> None:
    """Either end of the output socket: what may wait in it is bounded."""
    socket.setsockopt(zmq.SNDHWM if socket.type == zmq.PUSH else zmq.RCVHWM, OUTPUT_HWM)
    socket.setsockopt(zmq.SNDBUF if socket.type == zmq.PUSH else zmq.RCVBUF, buffer_bytes)


@dataclass(frozen=True)
class EngineFactory:
    """How an engine core builds its LLMEngine: `fn(*args, **kwargs)`, where fn is importable by module
    path (LLMEngine.from_engine_args in `servelab serve`, a stub-executor engine in tests)."""
    fn: Callable[..., "LLMEngine"]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def build(self) -> "LLMEngine":
        return self.fn(*self.args, **self.kwargs)


def engine_from_args(args: "EngineArgs") -> "LLMEngine":
    """`servelab serve`'s factory; torch and the weights load in the core's process only."""
    from servelab.engine.llm_engine import LLMEngine

    return LLMEngine.from_engine_args(args)


def run_engine_core(factory: EngineFactory, engine_index: int, input_address: str, output_address: str,
                    parent_pid: int, log_level: str = "INFO") -> None:
    """Process main. Exits 0 after a Shutdown message or when the API server is gone; 1 when the engine
    could not be built or the loop broke (the API server sees the exit and fails what was in flight)."""
    # Ctrl+C reaches the whole process group: the API server drains first, then sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _configure_logging(engine_index, log_level)
    codec = Codec()
    context = zmq.Context()
    inputs = context.socket(zmq.PULL)
    inputs.bind(input_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, OUTPUT_LINGER_MS)
    bound_output_socket(outputs)
    outputs.connect(output_address)
    code = 1
    engine = None
    try:
        try:
            engine = factory.build()
        except Exception as exc:
            logger.exception("engine core %d could not start", engine_index)
            outputs.send(codec.encode(EngineStartupFailed(engine_index, f"{type(exc).__name__}: {exc}")))
            return
        loop = EngineLoop(engine, engine_index)
        outputs.send(codec.encode(loop.ready(os.getpid())))
        code = _busy_loop(loop, inputs, outputs, codec, parent_pid)
    except ExecutorDeadError as exc:
        logger.error("engine core %d stops: %s", engine_index, exc)
        outputs.send(codec.encode(EngineDead(engine_index, str(exc))))
    except BaseException:
        logger.exception("engine core %d died", engine_index)
        raise
    finally:
        if engine is not None:
            # Before this process exits: multiprocessing would terminate the tensor-parallel workers (its
            # daemons), and rank 0 could not tell the ranks on other nodes to stop.
            engine.executor.shutdown()
        inputs.close(linger=0)
        outputs.close()
        context.term()
        if code:
            sys.exit(code)


def _busy_loop(loop: EngineLoop, inputs: zmq.Socket, outputs: zmq.Socket, codec: Codec, parent_pid: int) -> int:
    pending: EngineStepOutputs | None = None  # outputs the full socket did not take yet
    poller = zmq.Poller()
    poller.register(inputs, zmq.POLLIN)
    while True:
        # Block while idle (bounded, to notice an orphaned core); between steps only take what is there.
        timeout = 0 if loop.has_work() else KV_POLL_MS if loop.has_pending_kv() else IDLE_POLL_MS
        if pending is not None and timeout:  # idle, with outputs waiting: wake when the socket takes them
            poller.register(outputs, zmq.POLLOUT)
            poller.poll(timeout)
            poller.unregister(outputs)
            timeout = 0
        messages = []
        while inputs.poll(timeout):
            messages.append(codec.decode_input(inputs.recv()))
            timeout = 0
        if any(isinstance(m, Shutdown) for m in messages) or os.getppid() != parent_pid:
            if pending is not None:
                outputs.send(codec.encode(pending))  # the last outputs leave (within OUTPUT_LINGER_MS)
            loop.engine.kv_handoff.shutdown()
            return 0
        result = loop.run_once(messages)
        if result is not None:
            if pending is None:
                pending = result
            else:
                coalesce(pending, result)
        # A full socket means the API server is OUTPUT_HWM messages behind: keep stepping, coalesce.
        if pending is not None and outputs.getsockopt(zmq.EVENTS) & zmq.POLLOUT:
            try:
                outputs.send(codec.encode(pending), zmq.NOBLOCK)
                pending = None
            except zmq.Again:
                pass


def _configure_logging(engine_index: int, level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(f"%(asctime)s %(levelname)s engine-core-{engine_index} %(name)s: "
                                           "%(message)s"))
    root = logging.getLogger("servelab")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False
