"""Starts a disaggregated prefill/decode deployment (`servelab serve --disaggregate P:D`): P prefill and
D decode engine-core processes, each with its own paged KV cache, all ranks of one torch.distributed
group (their KV connector's) that rendezvous through a store hosted here, on a port the OS picks."""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from servelab.config import KVTransferConfig
from servelab.engine.core_proc.core_process import EngineFactory
from servelab.engine.mp_client import STARTUP_TIMEOUT_S, MPClient, launch_engine_cores

STORE_HOST = "127.0.0.1"


@dataclass
class Deployment:
    cores: list[MPClient]  # the prefill instances first, then the decode ones
    store: dist.TCPStore  # kept while the cores run (their group's rendezvous)

    def close(self) -> None:
        for core in self.cores:
            core.close()


def instance_configs(num_prefill: int, num_decode: int, port: int, host: str = STORE_HOST,
                     timeout_s: float = 120.0) -> list[KVTransferConfig]:
    size = num_prefill + num_decode
    return [KVTransferConfig("kv_producer" if rank < num_prefill else "kv_consumer", rank, size, host, port,
                             timeout_s) for rank in range(size)]


def launch_disaggregated(factory_for: Callable[[KVTransferConfig], EngineFactory], num_prefill: int,
                         num_decode: int, log_level: str = "INFO", timeout: float = STARTUP_TIMEOUT_S,
                         transfer_timeout_s: float = 120.0) -> Deployment:
    """factory_for(config) builds the EngineFactory of the instance with that KVTransferConfig. Returns
    once every instance is ready (each joins the group while it starts); on failure all are stopped."""
    store = dist.TCPStore(STORE_HOST, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))
    configs = instance_configs(num_prefill, num_decode, store.port, timeout_s=transfer_timeout_s)
    cores = launch_engine_cores([factory_for(c) for c in configs], len(configs), log_level, timeout)
    return Deployment(cores, store)
