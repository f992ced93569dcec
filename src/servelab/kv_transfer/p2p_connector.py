"""P2PKVConnector: the worker-side half of the KV connector (vLLM's split; the scheduler-side half is
Scheduler.release_kv / add_prefilled). It moves a request's KV blocks between the paged caches of two
engine instances with torch.distributed point-to-point send/recv: gloo on CPU, NCCL where CUDA is.

Every instance of a disaggregated deployment is one rank (its kv_rank) of one group, joined through the
store the API server hosts. The API server starts each transfer on both ends with the same tag: the
prefill instance gathers the request's blocks of every layer into one tensor and sends it; the decode
instance receives it into a staging tensor of the same shape, which its engine writes into the blocks it
allocates when it admits the request. The KV bytes travel only this way; the zmq control messages carry
who sends what to whom.

Transfers run on one thread per peer, in the order they were started. Both ends of a pair are started in
the same order (the API server sends both messages at once), so they always meet, and a slow or dead peer
stalls only its own pair. The engine loop never waits on the wire: poll() hands back finished transfers.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from servelab.config import KVTransferConfig
from servelab.distributed.parallel_state import backend_for, keep_gloo_on_loopback

logger = logging.getLogger(__name__)


@dataclass
class KVTransferDone:
    request_id: str
    tag: int
    peer: int
    is_send: bool
    num_bytes: int
    seconds: float
    # what a receive brought: (num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim)
    staging: torch.Tensor | None = None
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class _PeerChannel:
    """One thread running one peer's transfers in order."""

    def __init__(self, peer: int, done: queue.SimpleQueue) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], KVTransferDone] | None] = queue.SimpleQueue()
        self._done = done
        self._thread = threading.Thread(target=self._run, name=f"servelab-kv-peer{peer}", daemon=True)
        self._thread.start()

    def submit(self, job: Callable[[], KVTransferDone]) -> None:
        self._jobs.put(job)

    def stop(self) -> None:
        self._jobs.put(None)

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            self._done.put(job())


class P2PKVConnector:
    def __init__(self, kv_caches: list[torch.Tensor], rank: int, world_size: int) -> None:
        """kv_caches: the engine's per-layer caches, (2, num_blocks, block_size, num_kv_heads, head_dim)."""
        self.kv_caches = kv_caches
        self.rank = rank
        self.world_size = world_size
        self._channels: dict[int, _PeerChannel] = {}
        self._done: queue.SimpleQueue[KVTransferDone] = queue.SimpleQueue()
        self.num_pending = 0

    @classmethod
    def from_config(cls, config: KVTransferConfig, kv_caches: list[torch.Tensor]) -> "P2PKVConnector":
        """Join the deployment's group (blocks until every instance has joined, bounded by the timeout,
        which also bounds each transfer: a peer that stopped answering fails it instead of hanging)."""
        keep_gloo_on_loopback(config.kv_ip)
        timeout = timedelta(seconds=config.timeout_s)
        store = dist.TCPStore(config.kv_ip, config.kv_port, is_master=False, timeout=timeout)
        dist.init_process_group(backend_for(kv_caches[0].device), store=store, rank=config.kv_rank,
                                world_size=config.kv_parallel_size, timeout=timeout)
        return cls(kv_caches, config.kv_rank, config.kv_parallel_size)

    def payload_shape(self, num_blocks: int) -> tuple[int, ...]:
        layer = self.kv_caches[0].shape
        return (len(self.kv_caches), layer[0], num_blocks, *layer[2:])

    def start_send(self, request_id: str, tag: int, dst: int, block_ids: list[int]) -> None:
        """Send the blocks' KV of every layer to rank dst. The blocks must stay allocated (and unwritten)
        until poll() returns this transfer."""
        def send() -> KVTransferDone:
            start = time.perf_counter()
            payload = torch.stack([cache[:, block_ids] for cache in self.kv_caches])
            num_bytes = payload.numel() * payload.element_size()
            try:
                dist.send(payload, dst, tag=tag)
            except Exception as exc:  # the peer died or timed out: the caller frees the blocks all the same
                return KVTransferDone(request_id, tag, dst, True, num_bytes, time.perf_counter() - start,
                                      error=f"{type(exc).__name__}: {exc}")
            return KVTransferDone(request_id, tag, dst, True, num_bytes, time.perf_counter() - start)

        self._channel(dst).submit(send)
        self.num_pending += 1

    def start_recv(self, request_id: str, tag: int, src: int, num_blocks: int) -> None:
        """Receive num_blocks blocks' KV from rank src into a staging tensor (returned by poll())."""
        def recv() -> KVTransferDone:
            start = time.perf_counter()
            staging = torch.empty(self.payload_shape(num_blocks), dtype=self.kv_caches[0].dtype,
                                  device=self.kv_caches[0].device)
            num_bytes = staging.numel() * staging.element_size()
            try:
                dist.recv(staging, src, tag=tag)
            except Exception as exc:
                return KVTransferDone(request_id, tag, src, False, num_bytes, time.perf_counter() - start,
                                      error=f"{type(exc).__name__}: {exc}")
            return KVTransferDone(request_id, tag, src, False, num_bytes, time.perf_counter() - start, staging)

        self._channel(src).submit(recv)
        self.num_pending += 1

    def poll(self) -> list[KVTransferDone]:
        """The transfers finished since the last call (without waiting)."""
        done = []
        while True:
            try:
                done.append(self._done.get_nowait())
            except queue.Empty:
                break
        self.num_pending -= len(done)
        for transfer in done:
            if not transfer.ok:
                logger.error("KV transfer %d (%s, peer rank %d) failed: %s", transfer.tag, transfer.request_id,
                             transfer.peer, transfer.error)
        return done

    def write_blocks(self, staging: torch.Tensor, block_ids: list[int]) -> None:
        """Put a received payload into this instance's blocks (between steps, on the engine's thread)."""
        index = torch.tensor(block_ids, dtype=torch.long, device=staging.device)
        for layer, cache in enumerate(self.kv_caches):
            cache.index_copy_(1, index, staging[layer])

    def shutdown(self) -> None:
        for channel in self._channels.values():
            channel.stop()

    def _channel(self, peer: int) -> _PeerChannel:
        if not 0 <= peer < self.world_size or peer == self.rank:
            raise ValueError(f"no KV peer rank {peer} in a group of {self.world_size} (this is rank {self.rank})")
        channel = self._channels.get(peer)
        if channel is None:
            channel = self._channels[peer] = _PeerChannel(peer, self._done)
        return channel
