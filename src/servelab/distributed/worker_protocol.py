"""What the driver and the tensor-parallel workers say to each other over their pipes: typed values,
pickled once by the sender."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from servelab.config import CacheConfig
from servelab.specs import ModelSpec
from servelab.core.plan import SampledToken, StepPlan


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker needs to build its shard; the rendezvous store is the driver's."""
    folder: Path
    model: ModelSpec
    cache: CacheConfig
    dtype: str
    max_model_len: int
    rank: int
    world_size: int
    store_host: str
    store_port: int
    num_threads: int
    collective_timeout_s: float
    # True when ranks run on several nodes: only rank 0 has a pipe from the driver, and it relays every
    # message to the other ranks with a torch.distributed broadcast.
    relay_messages: bool = False
    quantization: str | None = None  # EngineConfig.quantization


@dataclass(frozen=True)
class WorkerReady:
    rank: int
    pid: int
    hostname: str
    weight_bytes: int
    num_blocks: int


@dataclass(frozen=True)
class GroupReady:
    """Rank 0's answer once every rank holds its shard: each rank's WorkerReady, gathered over the group
    (ranks on other nodes have no pipe to the driver)."""
    ranks: tuple[WorkerReady, ...]


@dataclass(frozen=True)
class ExecuteStep:
    plan: StepPlan


@dataclass(frozen=True)
class StepDone:
    """The first rank's answer to ExecuteStep; the other ranks send nothing unless they fail."""
    sampled: dict[str, SampledToken]
    spec_sampled: dict[str, list[SampledToken]] = field(default_factory=dict)


@dataclass(frozen=True)
class WorkerFailed:
    rank: int
    error: str  # "ExceptionType: message"
    traceback: str


@dataclass(frozen=True)
class Shutdown:
    pass


@dataclass(frozen=True)
class KeepAlive:
    """Relayed by rank 0 while the driver is silent, so the other nodes' ranks, waiting in a broadcast,
    never reach the collective timeout on an idle server."""
