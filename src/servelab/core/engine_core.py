"""EngineCore: wires scheduler, executor and clock, and is the only caller of schedule / execute / update.

step_fn runs one batch iteration, the one chosen at construction, as vLLM's EngineCore chooses
step or step_with_batch_queue: step() for a real engine, or step_with_decode_runs() for the lab,
which prices a multi-step decode run at once when the scheduler's next steps are certain. Either
sends one StepStats to the stats sink per step or run; Prometheus and the lab's meters read those.
"""
from __future__ import annotations

import math
from bisect import bisect_left
from dataclasses import dataclass, field
from itertools import accumulate, chain
from typing import TYPE_CHECKING, Callable, Protocol

from servelab.core.clock import VirtualClock, WallClock
from servelab.core.engine_io import EngineCoreOutput
from servelab.core.plan import DecodeRunPlan, StepPlan, StepResult
from servelab.core.request import Request, RequestStatus
from servelab.core.scheduler import Scheduler

if TYPE_CHECKING:  # the lab-only decode-run package is imported only when an EngineCore takes runs
    from servelab.core.decode_runs.planner import DecodeRunPlanner
    from servelab.core.decode_runs.run_states import RunStates

# Longest decode run priced at once; runs end earlier at the horizon, at finishes and at block shortage.
MAX_DECODE_STEPS = 4096


class Executor(Protocol):
    def execute(self, plan: StepPlan) -> StepResult: ...


class DecodeRunExecutor(Executor, Protocol):
    """Prices a decode run's steps instead of running them (the cost model). Every member samples
    run_token_id at every step of a run: a token that stops no request."""

    run_token_id: int

    def price_decode_run(self, run: DecodeRunPlan, within: float = math.inf) -> tuple[list[float], list[tuple[int, int]]]:
        """Durations of the run's first steps, only those that can start within `within` seconds, and
        (number of steps, batch size) segments: the batch shrinks as members finish."""

    def execute_with_decode_run(self, run: DecodeRunPlan, plan: StepPlan) -> StepResult:
        """A one-step run plus the requests its plan admits, priced as one step."""


class GrammarConstraints(Protocol):
    """Structured output's hooks into the step (servelab/structured_output/manager.py implements them): a
    constrained request joins the scheduler once its grammar is compiled; each step's plan gets the bitmask
    of its constrained rows before it runs, and the matchers take the sampled tokens after."""

    def add_request(self, request: Request) -> None: ...
    def is_ready(self, request_id: str) -> bool: ...
    def error(self, request_id: str) -> str | None: ...
    def remove(self, request_id: str) -> None: ...
    def fill_bitmask(self, plan: StepPlan) -> None: ...
    def accept_tokens(self, plan: StepPlan, result: StepResult) -> list[str]: ...


@dataclass(slots=True)
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
    # A decode run's steps. Its start and duration span them, token counts are totals over them,
    # num_decode_requests counts step 1, and the states (num_running to num_reserved_unused_slots) are
    # those after its last step, as a step's are after it; run_states sums up those after each step.
    num_steps: int = 1
    # A priced decode run's (number of steps, batch size) segments, in order (the batch shrinks as
    # members finish). Its breakdown is left empty: CostModel.decode_breakdown gives the parts that do
    # not depend on context length, and attention takes the rest of the duration.
    decode_segments: list[tuple[int, int]] = field(default_factory=list)
    # When each of its steps ended (on the clock the requests' token times come from): one per step.
    step_ends: list[float] = field(default_factory=list)
    # A run of several steps: the means and peaks of the states after each of its steps.
    run_states: RunStates | None = None


@dataclass(slots=True)
class StepOutputs:
    outputs: list[EngineCoreOutput]
    stats: StepStats | None


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, clock: WallClock | VirtualClock,
                 stats_sink: Callable[[StepStats], None] | None = None, decode_runs: bool = False,
                 grammars: GrammarConstraints | None = None) -> None:
        """stats_sink gets each step's (or run's) StepStats. decode_runs chooses step_with_decode_runs
        as step_fn; it needs a DecodeRunExecutor and a VirtualClock. grammars constrains the requests that
        ask for structured output (without it, such a request is refused)."""
        self.scheduler = scheduler
        self.executor = executor
        self.clock = clock
        self.stats_sink = stats_sink
        if decode_runs and not isinstance(clock, VirtualClock):
            raise ValueError("decode runs price steps instead of running them: they need a VirtualClock")
        self.decode_runs: DecodeRunPlanner | None = None
        if decode_runs:
            from servelab.core.decode_runs.planner import DecodeRunPlanner as Planner
            self.decode_runs = Planner(scheduler)
        self.step_request_ids: tuple[str, ...] = ()  # the requests of the step the executor is running
        self.grammars = grammars
        # constrained requests whose grammar is still compiling, in arrival order; they join the scheduler when ready
        self.grammar_waiting: list[Request] = []

    def add_request(self, request: Request) -> None:
        if request.sampling_params.structured_outputs is not None:
            if self.grammars is None:
                raise ValueError("this engine has no structured output")
            if request.request_id in self.scheduler.requests or any(
                    r.request_id == request.request_id for r in self.grammar_waiting):
                raise ValueError(f"duplicate request id {request.request_id!r}")
            self.grammars.add_request(request)
            if not self.grammars.is_ready(request.request_id):
                self.grammar_waiting.append(request)
                return
        self.scheduler.add_request(request)

    def _admit_compiled(self) -> list[EngineCoreOutput]:
        """Move the requests whose grammar is now compiled into the scheduler; one whose grammar failed
        finishes (aborted) with an output, never silently."""
        grammars, outputs, waiting = self.grammars, [], []
        assert grammars is not None  # only constrained requests wait, and only an engine with grammars takes them
        for request in self.grammar_waiting:
            if not grammars.is_ready(request.request_id):
                waiting.append(request)
            elif grammars.error(request.request_id) is not None:
                request.status = RequestStatus.FINISHED_ABORTED
                request.times.finished = self.clock.now()
                grammars.remove(request.request_id)
                outputs.append(request.output([]))
            else:
                self.scheduler.add_request(request)
        self.grammar_waiting = waiting
        return outputs

    def abort_requests(self, request_ids: list[str]) -> list[EngineCoreOutput]:
        return self.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[EngineCoreOutput]:
        """Retire requests between steps, for a reason decided outside the core: an abort, or a stop
        string the output processor matched. Unknown and already finished ids are skipped."""
        self._settle_decode_run()
        now = self.clock.now()
        outputs = []
        requests = self.scheduler.requests
        for request_id in request_ids:
            request = requests.get(request_id)
            if self.grammars is not None:
                self.grammars.remove(request_id)
                if request is None:
                    request = self._take_grammar_waiting(request_id)
                    if request is not None:
                        request.status = status
                        request.times.finished = now
                        outputs.append(request.output([]))
                        continue
            if request is None or request.finished:
                continue
            request.times.finished = now
            self.scheduler.finish_request(request, status)
            outputs.append(request.output([]))
        return outputs

    def _take_grammar_waiting(self, request_id: str) -> Request | None:
        for index, request in enumerate(self.grammar_waiting):
            if request.request_id == request_id:
                return self.grammar_waiting.pop(index)
        return None

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self.grammar_waiting)

    def step_fn(self, horizon: float = math.inf) -> StepOutputs:
        """The step function chosen at construction: step_with_decode_runs with decode runs, else step. A method
        and not an attribute holding a bound method, which would be a reference cycle through this core that
        keeps an engine's weights alive until a full garbage collection."""
        if self.decode_runs is not None:
            return self.step_with_decode_runs(horizon)
        return self.step(horizon)

    def step(self, horizon: float = math.inf) -> StepOutputs:
        """One batch iteration; it starts now, so the step functions' horizon (see
        step_with_decode_runs) does not bound it."""
        self._settle_decode_run()
        self.step_request_ids = ()
        grammars = self.grammars
        failed = self._admit_compiled() if self.grammar_waiting else []
        start = self.clock.now()
        plan = self.scheduler.schedule(start)
        if plan.is_empty and not plan.finished_request_ids:
            return StepOutputs(failed, None)
        # Kept until the step is done: when it raises, these are the requests whose step failed.
        self.step_request_ids = tuple(s.request_id for s in plan.scheduled)
        if grammars is not None:
            for request_id in plan.finished_request_ids:
                grammars.remove(request_id)
            grammars.fill_bitmask(plan)
        result = self.executor.execute(plan)
        self.clock.advance(result.duration)
        end = self.clock.now()
        terminated = grammars.accept_tokens(plan, result) if grammars is not None and plan.grammar_request_ids else ()
        updated = self.scheduler.update_from_output(plan, result, end)
        self.step_request_ids = ()
        for request_id in terminated:  # the grammar is complete: nothing may follow
            request = self.scheduler.requests.get(request_id)
            if request is not None and not request.finished:
                request.times.finished = end
                self.scheduler.finish_request(request, RequestStatus.FINISHED_STOPPED)
        outputs = failed + [r.output(new_tokens) for r, new_tokens in updated]
        return StepOutputs(outputs, self._emit(self._stats(plan, result, start, end)))

    def step_with_decode_runs(self, horizon: float = math.inf) -> StepOutputs:
        """A multi-step decode run when the scheduler's next steps are certain (DecodeRunPlanner.plan),
        else step(). The run is priced by the executor and taken up to its last step that starts before
        horizon. Its outputs are the requests it finished and those its one step admitted; the batch's
        tokens reach their requests when they finish (the lab reads requests, not outputs)."""
        planner = self.decode_runs
        assert planner is not None  # step_fn is this method only with decode runs
        run = planner.plan(MAX_DECODE_STEPS)
        if run is None:
            return self.step()
        executor: DecodeRunExecutor = self.executor  # type: ignore[assignment]  # checked by the lab's use
        clock: VirtualClock = self.clock  # type: ignore[assignment]  # checked in __init__
        scheduler = self.scheduler
        bm = scheduler.block_manager
        now = clock.now()
        num_steps, durations = run.num_steps, None
        if num_steps > 1:
            durations, segments = executor.price_decode_run(run, horizon - now)
            # sequential sums, so each end equals what single steps' clock.advance() calls would give
            ends = list(accumulate(chain((now,), durations)))  # not initial=: keyword arguments cost more in 3.11
            del ends[0]
            num_steps = 1 + bisect_left(ends, horizon, 0, len(ends) - 1)
            del ends[num_steps:]
        plan = planner.schedule(run, num_steps, now)
        result = None
        if num_steps == 1:
            if plan is not None and plan.scheduled:
                result = executor.execute_with_decode_run(run, plan)
                ends = [now + result.duration]
            elif durations is None:  # planned as one step (a longer run cut to one has its `ends` already)
                durations, segments = executor.price_decode_run(run)
                ends = [now + durations[0]]
        finished = planner.advance(run, executor.run_token_id, ends)
        end = ends[-1]
        clock.advance_to(end)
        outputs = [r.output([]) for r in finished] if finished else []
        batch_size = run.batch_size
        if result is None:
            breakdown, plan_tokens, plan_decode = {}, 0, 0
            if len(segments) > 1 or segments[0][0] != num_steps:
                segments, batch_tokens = _first_steps(segments, num_steps)
            else:
                batch_tokens = num_steps * batch_size
        else:
            assert plan is not None  # result is set only for a plan's step
            updated = scheduler.update_from_output(plan, result, end)
            outputs += [r.output(new_tokens) for r, new_tokens in updated]
            breakdown, segments, batch_tokens = result.breakdown, [], batch_size
            plan_tokens, plan_decode = _plan_counts(plan)
        stats = StepStats(
            now, end - now, batch_tokens + plan_tokens, plan_tokens - plan_decode, batch_size + plan_decode,
            len(scheduler.running), len(scheduler.waiting), 0, bm.usage, bm.num_reserved_unused_slots(), breakdown,
            num_steps, segments, ends, planner.run_states(run, now, ends) if num_steps > 1 else None)
        if self.stats_sink is not None:
            self.stats_sink(stats)
        return StepOutputs(outputs, stats)

    def _settle_decode_run(self) -> None:
        """Write the decode batch's lazily kept tokens before anything else reads the running requests."""
        if self.decode_runs is not None:
            self.decode_runs.settle()

    def _emit(self, stats: StepStats) -> StepStats:
        if self.stats_sink is not None:
            self.stats_sink(stats)
        return stats

    def _stats(self, plan: StepPlan, result: StepResult, start: float, end: float) -> StepStats:
        sched = self.scheduler
        num_tokens, decode = _plan_counts(plan)
        return StepStats(
            start=start,
            duration=end - start if result.duration == 0 else result.duration,
            num_scheduled_tokens=num_tokens,
            num_prefill_tokens=num_tokens - decode,
            num_decode_requests=decode,
            num_running=sched.num_running,
            num_waiting=sched.num_waiting,
            num_preempted=len(plan.preempted_request_ids),
            kv_usage=sched.block_manager.usage,
            num_reserved_unused_slots=sched.block_manager.num_reserved_unused_slots(),
            breakdown=result.breakdown,
            step_ends=[end],
        )


def _plan_counts(plan: StepPlan) -> tuple[int, int]:
    """(tokens scheduled, requests decoding: one token, or one and the drafts it verifies)."""
    num_tokens = num_decode = 0
    for s in plan.scheduled:
        num_new = len(s.token_ids)
        num_tokens += num_new
        if num_new - s.num_spec_tokens == 1 and s.num_computed_tokens > 0:
            num_decode += 1
    return num_tokens, num_decode


def _first_steps(segments: list[tuple[int, int]], num_steps: int) -> tuple[list[tuple[int, int]], int]:
    """The segments of a run's first num_steps steps, and the tokens they decode."""
    taken, left, num_tokens = [], num_steps, 0
    for count, batch_size in segments:
        if left < count:
            count = left
        taken.append((count, batch_size))
        num_tokens += count * batch_size
        left -= count
        if left <= 0:
            break
    return taken, num_tokens
