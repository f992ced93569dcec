"""This machine's KV-transfer cost, for the lab's disaggregated stage: two spawned processes join a gloo
group (as a prefill and a decode instance do) and time torch.distributed point-to-point sends of whole KV
blocks of the profiled model, 1 to 64 blocks; each timing is a send plus a one-byte answer, so it ends when
the bytes have landed. A least-squares line through them gives the per-transfer latency and the bytes/s
that the simulator prices a handoff with: seconds = latency + bytes / bytes_per_s."""
from __future__ import annotations

import multiprocessing
import time
from dataclasses import dataclass
from datetime import timedelta

NUM_BLOCKS = (1, 2, 4, 8, 16, 32, 64)
STORE_HOST = "127.0.0.1"


@dataclass(frozen=True)
class KVTransferFit:
    latency_s: float
    bytes_per_s: float
    samples: list[tuple[int, float]]  # (bytes, fastest seconds)

    def seconds(self, num_bytes: int) -> float:
        return self.latency_s + num_bytes / self.bytes_per_s


def _peer(rank: int, port: int, sizes: list[int], repeats: int, results) -> None:
    import torch
    import torch.distributed as dist

    from servelab.distributed.parallel_state import keep_gloo_on_loopback

    torch.set_num_threads(1)
    keep_gloo_on_loopback(STORE_HOST)
    store = dist.TCPStore(STORE_HOST, port, is_master=False, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    ack = torch.zeros(1, dtype=torch.uint8)
    timings = []
    for size in sizes:
        payload = torch.ones(size, dtype=torch.uint8)
        best = float("inf")
        for _ in range(repeats + 1):  # the first is a warm-up
            if rank == 0:
                start = time.perf_counter()
                dist.send(payload, 1)
                dist.recv(ack, 1)
                best = min(best, time.perf_counter() - start)
            else:
                dist.recv(payload, 0)
                dist.send(ack, 0)
        timings.append((size, best))
    if rank == 0:
        results.put(timings)
    dist.destroy_process_group()


def measure_kv_transfer(bytes_per_block: int, repeats: int = 5, timeout_s: float = 120.0) -> KVTransferFit:
    import torch.distributed as dist

    store = dist.TCPStore(STORE_HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    sizes = [n * bytes_per_block for n in NUM_BLOCKS]
    peers = [context.Process(target=_peer, args=(rank, store.port, sizes, repeats, results), daemon=True)
             for rank in (0, 1)]
    for p in peers:
        p.start()
    try:
        samples = results.get(timeout=timeout_s)
    finally:
        for p in peers:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    return fit_line(samples)


def fit_line(samples: list[tuple[int, float]]) -> KVTransferFit:
    n = len(samples)
    mean_x = sum(x for x, _ in samples) / n
    mean_y = sum(y for _, y in samples) / n
    slope = (sum((x - mean_x) * (y - mean_y) for x, y in samples)
             / sum((x - mean_x) ** 2 for x, _ in samples))
    latency = max(0.0, mean_y - slope * mean_x)
    return KVTransferFit(latency, 1.0 / slope if slope > 0 else float("inf"), samples)
