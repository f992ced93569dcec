"""A request as the engine core sees it: token ids, progress, status and timestamps."""
from __future__ import annotations

import enum
from typing import Any
from dataclasses import dataclass, field

from servelab.core.engine_io import EngineCoreOutput, EngineCoreRequest, EngineCoreTimes, KVTransferParams
from servelab.core.plan import SampledToken
from servelab.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED


_FINISHED = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    # a list while the engine writes it; a finished simulated request's is compacted (lab/sim/finished.py)
    token_times: Any = field(default_factory=list)
    finished: float | None = None


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Upper bound on generated tokens after clamping to the model's context.
    max_tokens: int
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_preemptions: int = 0
    kv_transfer: KVTransferParams | None = None
    # Whether the request takes part in prefix caching: its full blocks are hashed (core/block_hash.py),
    # looked up at admission and shared. Off for requests whose token ids are placeholders (the lab's
    # length-only workloads), which would otherwise all look alike.
    cache_prefix: bool = False
    # Hashes of its first full blocks, filled lazily by core/block_hash.request_block_hashes.
    block_hashes: list[bytes] = field(default_factory=list)
    times: RequestTimes = field(init=False)

    def __post_init__(self) -> None:
        self.times = RequestTimes(arrival=self.arrival_time)

    @classmethod
    def from_engine_core_request(cls, request: EngineCoreRequest) -> "Request":
        return cls(request.request_id, list(request.prompt_token_ids), request.sampling_params, request.max_tokens,
                   request.eos_token_ids, request.arrival_time, kv_transfer=request.kv_transfer, cache_prefix=True)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def max_total_tokens(self) -> int:
        return self.num_prompt_tokens + self.max_tokens

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n:end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def finished(self) -> bool:
        return self.status in _FINISHED  # RequestStatus.finished without its property calls (hot in the lab)

    def output(self, new_tokens: list[SampledToken]) -> EngineCoreOutput:
        """This request's state as a value leaving the core, with the tokens it got this step (none, one,
        or several when speculative drafts were accepted)."""
        times, status = self.times, self.status
        # _value_: RequestStatus.value without the enum property's call
        return EngineCoreOutput(self.request_id, new_tokens, status._value_ if status in _FINISHED else None,
                                EngineCoreTimes(times.arrival, times.first_scheduled, times.first_token,
                                                times.token_times[-1] if times.token_times else None, times.finished,
                                                self.num_preemptions))
