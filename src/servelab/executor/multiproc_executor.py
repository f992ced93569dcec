"""Tensor-parallel executor: N spawned worker processes hold one shard each, and the engine core's one
scheduler drives them all through this driver.

As in vLLM's multiproc executor, the driver (the engine-core process) holds no shard: rank 0 is a
worker like the others, and the driver only sends each StepPlan to every rank and reads rank 0's
samples back. The driver thus never joins a process group (several engines can live in one process,
and one that stops leaves nothing behind), every rank's death is seen the same way (its process
sentinel), and the driver's thread is free to watch them while the ranks compute.
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

import torch.distributed as dist

from servelab.config import EngineConfig
from servelab.core.plan import StepPlan, StepResult
from servelab.errors import ExecutorDeadError
from servelab.distributed.worker_protocol import (ExecuteStep, GroupReady, Shutdown, StepDone, WorkerFailed, WorkerReady,
                                           WorkerSpec)
from servelab.executor.tp_worker import run_worker
logger = logging.getLogger(__name__)


def num_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


class WorkerError(ExecutorDeadError):
    """A tensor-parallel worker died, failed or stopped answering; every worker has been stopped."""

    def __init__(self, message: str, reported: bool = False) -> None:
        super().__init__(message)
        self.reported = reported  # the worker sent its own traceback


def _failed(message: WorkerFailed) -> WorkerError:
    return WorkerError(f"tensor-parallel worker rank {message.rank} failed: {message.error}\n"
                       f"worker traceback:\n{message.traceback}", reported=True)


@dataclass
class _Workers:
    """This node's ranks, indexed from 0 (node 0's local index is the rank itself)."""
    relay: bool = False  # across nodes rank 0 relays each message to every other rank
    processes: list[BaseProcess] = field(default_factory=list)
    conns: list[Connection] = field(default_factory=list)  # the driver's end of each rank's pipe

    def broadcast(self, message: object) -> None:
        payload = bytes(ForkingPickler.dumps(message))  # pickled once for every rank
        for rank, conn in enumerate(self.conns[:1] if self.relay else self.conns):
            try:
                conn.send_bytes(payload)
            except OSError as e:
                raise self._lost(rank) from e

    def receive(self, ranks: list[int], timeout_s: float) -> list[object]:
        """One message from each of `ranks`, in order, watching every rank meanwhile: the others only
        speak to report a failure, and a process sentinel fires when its rank dies."""
        deadline = time.monotonic() + timeout_s
        sentinels = {p.sentinel: r for r, p in enumerate(self.processes)}
        messages: dict[int, object] = {}
        while len(messages) < len(ranks):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = [r for r in ranks if r not in messages]
                raise WorkerError(f"no answer from tensor-parallel worker ranks {missing} within {timeout_s:.0f} s")
            ready = wait([c for r, c in enumerate(self.conns) if r not in messages] + list(sentinels), remaining)
            dead = [sentinels[x] for x in ready if x in sentinels]
            if dead:
                # A rank that died without a word is the cause; the failures the others report (a
                # collective cut short) are its consequences.
                raise min((self._lost(r) for r in dead), key=lambda e: e.reported)
            for r, conn in enumerate(self.conns):
                if conn in ready:
                    message = self._recv(r)
                    if isinstance(message, WorkerFailed):
                        raise _failed(message)
                    if r not in ranks:
                        raise WorkerError(f"tensor-parallel worker rank {r} sent an unexpected "
                                          f"{type(message).__name__}")
                    messages[r] = message
        return [messages[r] for r in ranks]

    def _recv(self, rank: int) -> object:
        try:
            return self.conns[rank].recv()
        except (EOFError, OSError) as e:
            raise self._lost(rank) from e

    def _lost(self, rank: int) -> WorkerError:
        """The error for a rank whose process ended or whose pipe closed: its own report when it sent one."""
        conn, process = self.conns[rank], self.processes[rank]
        try:
            message = conn.recv() if conn.poll() else None
        except (EOFError, OSError):
            message = None
        if isinstance(message, WorkerFailed):
            return _failed(message)
        process.join(timeout=1.0)
        code = process.exitcode
        if code is None:
            how = "closed its pipe"
        elif code < 0:
            how = f"was killed by {signal.Signals(-code).name}"
        else:
            how = f"exited with code {code}"
        return WorkerError(f"tensor-parallel worker rank {rank} (pid {process.pid}) {how}; "
                           f"the engine has stopped all {len(self.processes)} workers")

    def stop(self, graceful: bool) -> None:
        """Ask every worker to exit (graceful), then terminate and finally kill whoever is left."""
        if graceful:
            for conn in self.conns:
                try:
                    conn.send(Shutdown())
                except OSError:
                    pass
            for process in self.processes:
                process.join(timeout=5.0)
        for process in self.processes:
            if process.is_alive():
                process.terminate()
                process.join(timeout=2.0)
        for process in self.processes:
            if process.is_alive():
                process.kill()
                process.join()
        for conn in self.conns:
            conn.close()


def spawn_workers(folder: Path, config: EngineConfig, store_host: str, store_port: int, num_threads: int,
                  collective_timeout_s: float) -> _Workers:
    """Start this node's ranks (config.parallel.local_ranks), each with a pipe to the caller."""
    parallel = config.parallel
    context = multiprocessing.get_context("spawn")
    workers = _Workers(relay=parallel.nnodes > 1)
    try:
        for rank in parallel.local_ranks:
            spec = WorkerSpec(folder, config.model, config.cache, config.dtype, config.scheduler.max_model_len,
                              rank, parallel.tensor_parallel_size, store_host, store_port, num_threads,
                              collective_timeout_s, relay_messages=parallel.nnodes > 1,
                              quantization=config.quantization)
            parent, child = context.Pipe()
            process = context.Process(target=run_worker, args=(spec, child), name=f"servelab-tp-rank{rank}",
                                      daemon=True)
            workers.processes.append(process)
            workers.conns.append(parent)
            process.start()
            child.close()
    except BaseException:
        workers.stop(graceful=False)
        raise
    return workers


class MultiprocExecutor:
    def __init__(self, workers: _Workers, store: dist.TCPStore, ranks: tuple[WorkerReady, ...], block_size: int,
                 step_timeout_s: float) -> None:
        self._workers = workers
        self._store = store  # the rendezvous; kept for the workers' lifetime
        self.block_size = block_size
        self.num_blocks = ranks[0].num_blocks
        self.worker_ranks = ranks  # every rank's pid, host, weights: node 0's and the other nodes'
        self.weight_bytes_per_rank = tuple(r.weight_bytes for r in ranks)
        self.worker_pids = tuple(r.pid for r in ranks)
        self.step_timeout_s = step_timeout_s
        # Runs once: on shutdown(), when the executor is garbage-collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, workers.stop, graceful=True)

    @classmethod
    def from_pretrained(cls, folder: Path, config: EngineConfig, num_threads: int | None = None,
                        startup_timeout_s: float = 600.0, step_timeout_s: float = 600.0,
                        collective_timeout_s: float = 300.0) -> "MultiprocExecutor":
        """Spawn node 0's ranks and wait until every rank, on every node, holds its shard. The driver
        hosts the rendezvous store (on a port the OS picks unless --master-port is given); any failure
        stops this node's workers before raising."""
        parallel = config.parallel
        if parallel.node_rank != 0:
            raise ValueError(f"node {parallel.node_rank} runs only its worker ranks, not an engine: start it "
                             "with `servelab serve --headless`")
        threads = num_threads or max(1, num_cores() // parallel.ranks_per_node)
        store = dist.TCPStore(parallel.master_addr, parallel.master_port or 0, is_master=True,
                              wait_for_workers=False, timeout=timedelta(seconds=startup_timeout_s))
        workers = spawn_workers(folder, config, parallel.master_addr, store.port, threads, collective_timeout_s)
        try:
            [ready] = workers.receive([0], startup_timeout_s)
            if not isinstance(ready, GroupReady):
                raise WorkerError(f"tensor-parallel worker rank 0 answered its start with {type(ready).__name__}")
            if len({r.num_blocks for r in ready.ranks}) != 1:
                raise WorkerError(f"ranks sized their KV caches differently: {[r.num_blocks for r in ready.ranks]}")
        except BaseException:
            workers.stop(graceful=False)
            raise
        logger.info("tensor-parallel ranks ready: %s", ", ".join(f"rank {r.rank} pid {r.pid} on {r.hostname}"
                                                                 for r in ready.ranks))
        return cls(workers, store, ready.ranks, config.cache.block_size, step_timeout_s)

    @property
    def weight_bytes(self) -> int:
        """Every rank's weights together (replicated norms counted on each rank)."""
        return sum(self.weight_bytes_per_rank)

    def execute(self, plan: StepPlan) -> StepResult:
        if not self._finalizer.alive:
            raise WorkerError("the tensor-parallel workers have been stopped")
        start = time.perf_counter()
        plan.grammar_bitmask_now()  # the ranks get the filled array, not its future
        try:
            self._workers.broadcast(ExecuteStep(plan))
            [done] = self._workers.receive([0], self.step_timeout_s)
        except WorkerError:
            self._stop(graceful=False)
            raise
        if not isinstance(done, StepDone):
            self._stop(graceful=False)
            raise WorkerError(f"tensor-parallel worker rank 0 answered a step with {type(done).__name__}")
        return StepResult(sampled=done.sampled, duration=time.perf_counter() - start, spec_sampled=done.spec_sampled)

    def shutdown(self) -> None:
        self._stop(graceful=True)

    def _stop(self, graceful: bool) -> None:
        if self._finalizer.detach() is not None:
            self._workers.stop(graceful)
