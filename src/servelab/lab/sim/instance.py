"""One simulated instance: servelab's own Scheduler and BlockManager driving a CostModelExecutor on a
virtual clock, plus the step records the meters read."""
from __future__ import annotations

from bisect import bisect_left
from itertools import accumulate

from servelab.config import SchedulerConfig
from servelab.core.block_manager import BlockManager
from servelab.core.clock import VirtualClock
from servelab.core.engine import EngineCore
from servelab.core.multi_step import DecodeRun
from servelab.core.request import Request
from servelab.core.scheduler import Scheduler
from servelab.executor.cost_model import DUMMY_TOKEN_ID, CostModel, CostModelExecutor

# Longest multi-step decode run priced at once; runs end earlier at arrivals, finishes and block shortage.
MAX_DECODE_STEPS = 4096
BREAKDOWN_KEYS = ("weights", "attention", "communication", "overhead")


class Instance:
    def __init__(self, index: int, role: str, scheduler_config: SchedulerConfig, num_blocks: int, block_size: int,
                 cost_model: CostModel, multi_step: bool = True) -> None:
        self.index = index
        self.role = role  # "mixed", "prefill" or "decode"
        self.block_manager = BlockManager(num_blocks, block_size)
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        self.executor = CostModelExecutor(cost_model)
        self.engine = EngineCore(self.scheduler, self.executor, VirtualClock())
        self.clock = self.engine.clock
        self.multi_step = multi_step
        self.num_outstanding = 0  # routed here and not finished, as the router sees it
        self.busy = False
        self.next_step_time = float("inf")
        self.pending_finished: list[Request] = []  # finished by the step in flight, visible at its end
        self.num_steps = 0
        self.breakdown = dict.fromkeys(BREAKDOWN_KEYS, 0.0)  # of single steps; runs: see breakdown_totals()
        self._decode_steps_by_batch: dict[int, int] = {}
        self._decode_run_time = 0.0
        # one entry per step (or per multi-step run): start, duration, running, waiting, KV usage, unused slots
        self.starts: list[float] = []
        self.durations: list[float] = []
        self.running: list[int] = []
        self.waiting: list[int] = []
        self.kv_usage: list[float] = []
        self.reserved_unused: list[int] = []

    def add_request(self, request: Request) -> None:
        self.engine.add_request(request)
        self.num_outstanding += 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def step(self, now: float, horizon: float) -> float | None:
        """Run the next step, or multi-step decode run whose later steps all start before horizon (the
        earliest time anything from outside can reach this instance). Returns its end time, or None
        when the scheduler had nothing to run."""
        if self.multi_step:
            run = self.scheduler.plan_decode_run(MAX_DECODE_STEPS)
            if run is not None:
                return self._decode_run(now, run, horizon)
        # EngineCore.step's four calls; its per-request EngineCoreOutputs and StepStats are left out:
        # the lab reads request timestamps and its own records, and builds no output objects.
        self.clock.advance_to(now)
        scheduler = self.scheduler
        plan = scheduler.schedule(now)
        if plan.is_empty and not plan.finished_request_ids:
            return None
        result = self.executor.execute(plan)
        self.clock.advance(result.duration)
        end = self.clock.now()
        updated = scheduler.update_from_output(plan, result, end)
        self.num_steps += 1
        breakdown = self.breakdown
        for key, value in result.breakdown.items():
            breakdown[key] += value
        self._record(now, result.duration, len(scheduler.running), len(scheduler.waiting), self.block_manager.usage,
                     scheduler.num_reserved_unused_slots())
        self.pending_finished = [r for r in updated if r.times.finished is not None]
        return end

    def _decode_run(self, now: float, run: DecodeRun, horizon: float) -> float:
        scheduler, bm, executor = self.scheduler, self.block_manager, self.executor
        num_steps = run.num_steps
        durations = None
        if num_steps > 1:
            durations, segments = executor.price_decode_run(run, horizon - now)
            # sequential sums, so each end equals what single steps' clock.advance() calls would give
            ends = list(accumulate(durations, initial=now))
            del ends[0]
            num_steps = 1 + bisect_left(ends, horizon, 0, len(ends) - 1)
            del ends[num_steps:]
        free_before = bm.num_free_blocks
        plan = scheduler.schedule_decode_run(run, num_steps, now)
        free_after = bm.num_free_blocks
        result = None
        if num_steps == 1:
            if plan.scheduled:
                result = executor.execute_with_decode_run(run, plan)
                ends = [now + result.duration]
            elif durations is None:  # planned as one step (a longer run cut to one has its `ends` already)
                durations, segments = executor.price_decode_run(run)
                ends = [now + durations[0]]
        finished = scheduler.advance_decode_run(run, DUMMY_TOKEN_ID, ends)
        end = ends[-1]
        if result is not None:
            finished += [r for r in scheduler.update_from_output(plan, result, end) if r.times.finished is not None]
            for key, value in result.breakdown.items():
                self.breakdown[key] += value
        else:
            left, by_batch = num_steps, self._decode_steps_by_batch
            for count, batch_size in segments:
                by_batch[batch_size] = by_batch.get(batch_size, 0) + min(count, left)
                left -= count
                if left <= 0:
                    break
            self._decode_run_time += end - now
        self.clock.advance_to(end)
        self.num_steps += num_steps
        # KV use: the mean of before and after the run's allocations (it grows about linearly)
        self._record(now, end - now, len(run.batch) + len(plan.scheduled), len(scheduler.waiting),
                     1 - (free_before + free_after) / (2 * bm.num_blocks), scheduler.num_reserved_unused_slots())
        self.pending_finished = finished
        return end

    def breakdown_totals(self) -> dict[str, float]:
        """Seconds spent per cost component over the whole run."""
        totals = dict(self.breakdown)
        fixed = 0.0
        for batch_size, count in self._decode_steps_by_batch.items():
            for key, value in self.executor.cost_model.decode_breakdown(batch_size).items():
                totals[key] += value * count
                fixed += value * count
        totals["attention"] += self._decode_run_time - fixed
        return totals

    def _record(self, start, duration, running, waiting, kv_usage, reserved_unused) -> None:
        self.starts.append(start)
        self.durations.append(duration)
        self.running.append(running)
        self.waiting.append(waiting)
        self.kv_usage.append(kv_usage)
        self.reserved_unused.append(reserved_unused)
