"""A tensor-parallel worker process: joins the group, builds its shard of the model and its own
paged KV cache, then runs every StepPlan the driver sends until told to stop."""
from __future__ import annotations

import os
import signal
import sys
import traceback
from multiprocessing.connection import Connection

import torch

from servelab.distributed.messages import ExecuteStep, Shutdown, StepDone, WorkerFailed, WorkerReady, WorkerSpec
from servelab.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from servelab.executor.model_executor import ModelExecutor
from servelab.model.loader import DTYPES


def run_worker(spec: WorkerSpec, conn: Connection) -> None:
    """The process target (started with `spawn`). Any exception is reported to the driver, which
    stops every rank; a closed pipe means the driver is gone, and the worker exits."""
    # Ctrl+C reaches the whole process group: the driver decides when the workers stop (a server
    # drains its requests first), and tells them through the pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
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


def _serve(spec: WorkerSpec, conn: Connection) -> None:
    torch.set_num_threads(spec.num_threads)
    tp = init_tensor_parallel(spec.rank, spec.world_size, spec.store_host, spec.store_port, torch.device("cpu"),
                              spec.collective_timeout_s)
    executor = ModelExecutor.from_pretrained(spec.folder, spec.model, spec.cache, DTYPES[spec.dtype],
                                             spec.max_model_len, tp=tp)
    conn.send(WorkerReady(spec.rank, os.getpid(), executor.weight_bytes, executor.num_blocks))
    while True:
        try:
            message = conn.recv()
        except EOFError:  # the driver is gone
            return
        if isinstance(message, Shutdown):
            return
        if not isinstance(message, ExecuteStep):
            raise TypeError(f"worker got an unexpected message {type(message).__name__}")
        result = executor.execute(message.plan)
        if tp.is_first_rank:
            conn.send(StepDone(result.sampled))
