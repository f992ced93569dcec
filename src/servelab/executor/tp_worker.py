"""A tensor-parallel worker process: joins the group, builds its shard of the model and its own
paged KV cache, then runs every StepPlan the driver sends until told to stop.

On one node every rank reads the driver's messages from its own pipe. Across nodes only rank 0 has a
pipe (the driver is on node 0); it relays each message to the others with a torch.distributed
broadcast, and a KeepAlive while the driver is silent."""
from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
import traceback
from multiprocessing.connection import Connection

import torch

from servelab.distributed.worker_protocol import (ExecuteStep, GroupReady, KeepAlive, Shutdown, StepDone, WorkerFailed,
                                           WorkerReady, WorkerSpec)
from servelab.distributed.parallel_state import TensorParallelGroup, destroy_tensor_parallel, init_tensor_parallel
from servelab.executor.model_executor import ModelExecutor
from servelab.model.loader import DTYPES

# How long rank 0 waits for the driver before relaying a KeepAlive; far below any collective timeout.
KEEPALIVE_S = 5.0
ORPHAN_POLL_S = 0.5


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """The process target (started with `spawn`). Any exception is reported to the driver, which
    stops every rank; a closed pipe or a parent that is gone means the driver is gone, and the worker exits."""
    # Ctrl+C reaches the whole process group: the driver decides when the workers stop (a server
    # drains its requests first), and tells them through the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # A rank waiting in a collective never reads its pipe: it learns that its parent died from here.
    threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True).start()
    exit_code = 0
    try:
        _serve(spec, conn)
    except BaseException as e:
        exit_code = 1
        try:
            conn.send(WorkerFailed(spec.rank, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:
            pass
    destroy_tensor_parallel()
    conn.close()
    sys.stdout.flush()
    sys.stderr.flush()
    # Interpreter teardown with torch and gloo loaded takes seconds (C++ static destructors) and
    # has nothing left to do for a worker: leave at once.
    os._exit(exit_code)


def _exit_when_orphaned(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(ORPHAN_POLL_S)
    os._exit(1)


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    torch.set_num_threads(spec.num_threads)
    tp = init_tensor_parallel(spec.rank, spec.world_size, spec.store_host, spec.store_port, torch.device("cpu"),
                              spec.collective_timeout_s)
    executor = ModelExecutor.from_pretrained(spec.folder, spec.model, spec.cache, DTYPES[spec.dtype],
                                             spec.max_model_len, tp=tp, quantization=spec.quantization)
    ready = WorkerReady(spec.rank, os.getpid(), socket.gethostname(), executor.weight_bytes, executor.num_blocks)
    ranks = tp.all_gather_object(ready)
    if tp.is_first_rank:
        conn.send(GroupReady(tuple(ranks)))
    while True:
        message = _next_message(spec, tp, conn)
        if isinstance(message, Shutdown):
            return
        if isinstance(message, KeepAlive):
            continue
        if not isinstance(message, ExecuteStep):
            raise TypeError(f"worker got an unexpected message {type(message).__name__}")
        result = executor.execute(message.plan)
        if tp.is_first_rank:
            conn.send(StepDone(result.sampled, result.spec_sampled))


def _next_message(spec: WorkerSpec, tp: TensorParallelGroup, conn: Connection) -> object:
    if not spec.relay_messages:
        return _receive(conn)
    if not tp.is_first_rank:
        return tp.broadcast_object(None)
    message = _receive(conn) if conn.poll(KEEPALIVE_S) else KeepAlive()
    return tp.broadcast_object(message)


def _receive(conn: Connection) -> object:
    try:
        return conn.recv()
    except EOFError:  # the driver is gone
        return Shutdown()
