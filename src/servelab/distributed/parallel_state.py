"""The tensor-parallel group a rank belongs to, and the two collectives the model calls on it.

One group per worker process: torch.distributed's default group, joined through a TCPStore that the
driver hosts on a port the OS picks. A group of size 1 is the single-process engine: no process
group exists and every collective is the identity.
"""
from __future__ import annotations

import os
import socket
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TensorParallelGroup:
    rank: int = 0
    world_size: int = 1

    @property
    def is_first_rank(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of x over the ranks, in place."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Every rank's x concatenated along the last dimension, on the first rank; None on the others."""
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)] if self.is_first_rank else None
        dist.gather(x, parts, dst=0)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def all_gather_object(self, obj: object) -> list[object]:
        """Every rank's obj (picklable), in rank order, on every rank."""
        if self.world_size == 1:
            return [obj]
        gathered: list[object] = [None] * self.world_size
        dist.all_gather_object(gathered, obj)
        return gathered

    def broadcast_object(self, obj: object) -> object:
        """The first rank's obj on every rank (the others pass None)."""
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]


SINGLE_RANK = TensorParallelGroup()


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def _loopback_interface() -> str | None:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), None)


def keep_gloo_on_loopback(store_host: str) -> None:
    """With the store on 127.0.0.1, gloo's own connections stay on the loopback too."""
    if store_host == "127.0.0.1" and "GLOO_SOCKET_IFNAME" not in os.environ:
        loopback = _loopback_interface()
        if loopback is not None:
            os.environ["GLOO_SOCKET_IFNAME"] = loopback


def init_tensor_parallel(rank: int, world_size: int, store_host: str, store_port: int, device: torch.device,
                         timeout_s: float) -> TensorParallelGroup:
    """Join the group through the driver's store. timeout_s bounds the rendezvous and every
    collective: a rank whose peer stopped answering raises instead of waiting for ever."""
    keep_gloo_on_loopback(store_host)
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout)
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size, timeout=timeout)
    return TensorParallelGroup(rank, world_size)


def destroy_tensor_parallel() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
