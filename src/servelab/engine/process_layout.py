"""The serving processes as they run: the API server, its engine cores (each with its role) and their
tensor-parallel worker ranks, with pids and hosts. The lab page draws it (`/lab/api/live/layout`); a
value built from what each core announced (EngineReady), so reading it never asks a core anything."""
from __future__ import annotations

import os
import socket
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from servelab.engine.core_client import EngineCoreClient


@dataclass(frozen=True)
class RankLayout:
    rank: int
    pid: int
    host: str


@dataclass(frozen=True)
class EngineLayout:
    engine_index: int
    role: str  # colocated | prefill | decode
    pid: int
    alive: bool
    # Tensor-parallel ranks; one rank in the engine core's own process when it runs the model itself.
    ranks: tuple[RankLayout, ...]
    # KV handoffs this engine sent (prefill) or received (decode) under --disaggregate; 0 when colocated.
    num_kv_handoffs: int = 0
    # --quantization as resolved (none | gguf | int8), the KV cache dtype, and why (model/quant/auto_quantization.py)
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    quantization_reason: str = ""


@dataclass(frozen=True)
class ProcessLayout:
    api_server_pid: int
    host: str
    engines: tuple[EngineLayout, ...]

    @property
    def tensor_parallel_size(self) -> int:
        return max((len(e.ranks) for e in self.engines), default=1)

    def to_json(self) -> dict:
        return {**asdict(self), "tensor_parallel_size": self.tensor_parallel_size,
                "data_parallel_size": len(self.engines)}


def process_layout(cores: list[EngineCoreClient]) -> ProcessLayout:
    host = socket.gethostname()
    engines = []
    for core in cores:
        info = core.info
        ranks = tuple(RankLayout(r.rank, r.pid, r.host) for r in info.ranks) or (RankLayout(0, info.pid, host),)
        engines.append(EngineLayout(info.engine_index, info.role, info.pid, core.is_alive(), ranks,
                                    core.num_kv_handoffs, info.quantization, info.kv_cache_dtype,
                                    info.quantization_reason))
    return ProcessLayout(os.getpid(), host, tuple(engines))
