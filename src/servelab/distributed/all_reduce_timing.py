"""Times torch.distributed all-reduces between worker processes on this machine (gloo over the
loopback, as `-tp N` runs them), for the lab's local-cpu profile: the seconds one all-reduce of each
message size takes, as rank 0 sees it."""
from __future__ import annotations

import multiprocessing
import statistics
import time
from datetime import timedelta
from multiprocessing.connection import Connection

import torch
import torch.distributed as dist

from servelab.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel

STORE_HOST = "127.0.0.1"
# Bytes per all-reduce: one token's hidden state of a small model up to a 2048-token fp32 prefill chunk.
MESSAGE_BYTES = (256, 4096, 65536, 524288, 2097152, 8388608)
WARMUP = 3


def time_all_reduce(world_size: int, repeats: int = 20, message_bytes: tuple[int, ...] = MESSAGE_BYTES,
                    timeout_s: float = 120.0) -> list[tuple[int, float]]:
    """(bytes, median seconds per all-reduce) for each message size, one thread per rank."""
    store = dist.TCPStore(STORE_HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    context = multiprocessing.get_context("spawn")
    receiver, sender = context.Pipe(duplex=False)
    processes = [context.Process(target=_rank_main, args=(rank, world_size, store.port, message_bytes, repeats,
                                                          timeout_s, sender if rank == 0 else None),
                                 name=f"servelab-all-reduce-rank{rank}", daemon=True) for rank in range(world_size)]
    try:
        for process in processes:
            process.start()
        sender.close()
        if not receiver.poll(timeout_s):
            raise RuntimeError(f"the {world_size}-rank all-reduce timing gave no result within {timeout_s:g} s")
        result = receiver.recv()
        if isinstance(result, str):
            raise RuntimeError(f"the {world_size}-rank all-reduce timing failed: {result}")
        return result
    finally:
        for process in processes:
            process.join(timeout=10.0)
            if process.is_alive():
                process.kill()
                process.join()


def _rank_main(rank: int, world_size: int, port: int, message_bytes: tuple[int, ...], repeats: int,
               timeout_s: float, conn: Connection | None) -> None:
    torch.set_num_threads(1)
    try:
        init_tensor_parallel(rank, world_size, STORE_HOST, port, torch.device("cpu"), timeout_s)
        result = []
        for size in message_bytes:
            x = torch.ones(size // 4, dtype=torch.float32)
            seconds = []
            for i in range(WARMUP + repeats):
                dist.barrier()
                start = time.perf_counter()
                dist.all_reduce(x)
                seconds.append(time.perf_counter() - start)
            result.append((size, statistics.median(seconds[WARMUP:])))
        if conn is not None:
            conn.send(result)
    except Exception as exc:
        if conn is not None:
            conn.send(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        destroy_tensor_parallel()
