"""EngineCore: wires scheduler, executor and clock; one call to step() is one batch iteration."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from servelab.core.clock import VirtualClock, WallClock
from servelab.core.messages import EngineCoreOutput
from servelab.core.plan import StepPlan, StepResult
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


@dataclass
class StepStats:
    start: float
    duration: float
    num_scheduled_tokens: int
    num_prefill_tokens: int
    num_decode_requests: int
    num_running: int
    num_waiting: int
    num_preempted: int
    kv_usage: float
    num_reserved_unused_slots: int
    breakdown: dict[str, float] = field(default_factory=dict)


@dataclass
class StepOutputs:
    outputs: list[EngineCoreOutput]
    stats: StepStats | None


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, clock: WallClock | VirtualClock) -> None:
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock

    def add_request(self, request: Request) -> None:
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[EngineCoreOutput]:
        """Retire requests between steps, for a reason decided outside the core: an abort, or a stop
        string the output processor matched. Unknown and already finished ids are skipped."""
        now = self.clock.now()
        outputs = []
        requests = self.scheduler.requests
        for request_id in request_ids:
            request = requests.get(request_id)
            if request is None or request.finished:
                continue
            request.times.finished = now
            self.scheduler.finish_request(request, status)
            outputs.append(EngineCoreOutput.from_request(request, None))
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self) -> StepOutputs:
        start = self.clock.now()
        plan = self.scheduler.schedule(start)
        if plan.is_empty and not plan.finished_request_ids:
            return StepOutputs([], None)
        result = self.executor.execute(plan)
        self.clock.advance(result.duration)
        end = self.clock.now()
        updated = self.scheduler.update_from_output(plan, result, end)
        outputs = [EngineCoreOutput.from_request(r, result.sampled.get(r.request_id)) for r in updated]
        return StepOutputs(outputs, self._stats(plan, result, start, end))

    def _stats(self, plan: StepPlan, result: StepResult, start: float, end: float) -> StepStats:
        sched = self.scheduler
        decode = sum(1 for s in plan.scheduled if s.num_new_tokens == 1 and s.num_computed_tokens > 0)
        return StepStats(
            start=start,
            duration=end - start if result.duration == 0 else result.duration,
            num_scheduled_tokens=plan.num_scheduled_tokens,
            num_prefill_tokens=plan.num_scheduled_tokens - decode,
            num_decode_requests=decode,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_preempted=len(plan.preempted_request_ids),
            kv_usage=sched.block_manager.usage,
            num_reserved_unused_slots=sched.block_manager.num_reserved_unused_slots(),
            breakdown=result.breakdown,
        )
