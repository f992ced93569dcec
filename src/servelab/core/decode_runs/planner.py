"""Multi-step decode runs (vLLM's num_scheduler_steps): one scheduling decision for a run of decode steps.

When every running request is decoding and nothing can change the batch (no admission, no block
shortage), the scheduler's next k steps are known in advance: each plans the batch's unfinished
requests for one token each. A DecodeRunPlan (core/plan.py) describes those k steps, which is all a
cost model needs to price them, so EngineCore.step_with_decode_runs takes such a run in one go. A
one-step run may also admit waiting requests, exactly as schedule() would (they come back as an
ordinary StepPlan). Tokens, timestamps, block ids and pool state are identical to single steps
(tests/core/decode_runs/test_multi_step.py).

The planner is composed with the Scheduler, not part of it: it reads the scheduler's public queues and
block manager, and changes them only through Scheduler.admit / finish_request and the block manager's
allocation calls. The scheduler knows nothing of runs; in exchange, settle() must run before anything
else reads or changes the running requests (EngineCore calls it before schedule(), aborts and stop-string
finishes), since their tokens and timestamps are written lazily (core/decode_runs/batch.py). Each run's
KV tokens are counted in the block manager as it is taken, so its reserved-unused count is exact
after every run.
"""
from __future__ import annotations

from collections.abc import Sequence

from servelab.core.decode_runs.batch import DecodeBatch
from servelab.core.plan import DecodeRunPlan, StepPlan
from servelab.core.request import Request, RequestStatus
from servelab.core.decode_runs.run_states import RunStates, run_states
from servelab.core.scheduler import Scheduler


class DecodeRunPlanner:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._batch: DecodeBatch | None = None
        # The run taken last, for run_states: blocks in use and unfilled slots before it, the steps of
        # its block allocations, and its departures (step, blocks freed, unfilled slots freed).
        self._before = (0, 0)
        self._alloc_steps: Sequence[int] = ()
        self._departures: list[tuple[int, int, int]] = []

    def plan(self, limit: int) -> DecodeRunPlan | None:
        """The longest run (at most limit steps) that schedule() would certainly make of one decode
        token for every running request still unfinished, in order, with no preemption, if nothing
        arrives: no one is mid-prefill or could be stopped by a sampled token, the pool has the blocks,
        and (beyond the first step) nobody waiting can be admitted. Requests finishing on length leave
        the batch at their step; the run goes past a finish only when nobody waits (a finish could let
        the waiting head in). None when the next step needs a full schedule()."""
        scheduler = self.scheduler
        running = scheduler.running
        batch_size = len(running)
        max_num_batched_tokens = scheduler.config.max_num_batched_tokens
        if not running or limit < 1 or batch_size > max_num_batched_tokens:
            return None
        batch = self._batch
        if batch is None or not batch.lasts:  # none yet, or everyone left: start counting steps afresh
            batch = self._batch = DecodeBatch()
        if len(batch.lasts) < batch_size and not self._join(batch):
            return None
        step = batch.step
        soonest = min(batch.lasts) - step
        if scheduler.contiguous:  # reservations cover max_tokens; no admission till all finish
            num_steps = max(batch.lasts) - step
            return self._run(batch, limit if limit < num_steps else num_steps, soonest)
        bm = scheduler.block_manager
        num_free = bm.num_free_blocks
        if batch_size > num_free and batch.allocs.count(step + 1) > num_free:
            return None  # the next step preempts someone
        mixed = scheduler.config.mixed_batches
        # with mixed batches the head joins the batch's step; without, it gets a step of its own
        budget = max_num_batched_tokens - batch_size if mixed else max_num_batched_tokens
        if scheduler.waiting and scheduler.pass_length > 1:
            # multi-step passes: nobody is admitted before the pass ends, finishes or not
            if scheduler.between_passes() and self._head_fits(batch_size, budget, num_free):
                return None  # the next step is a prefill of its own
            num_steps = min(limit, scheduler.steps_to_pass_end(), max(batch.lasts) - step)
        elif scheduler.waiting:
            # Free blocks only shrink until someone finishes, so a head that does not fit now will not
            # (evicting a cached block it would start from only adds to what it needs).
            if self._head_fits(batch_size, budget, num_free):
                return self._run(batch, 1, soonest, admits=True) if mixed else None
            num_steps = soonest if soonest < limit else limit
        else:
            num_steps = max(batch.lasts) - step
            if limit < num_steps:
                num_steps = limit
        # Blocks freed by finishes join the back of the free list, behind all the blocks counted here,
        # so the run's allocations get the same ids as single steps would.
        block_size = bm.block_size
        if (batch_size * -(-num_steps // block_size) > num_free  # each needs at most one block per block_size steps
                and batch.num_new_blocks(num_steps, block_size) > num_free):
            low, high = 1, num_steps  # blocks for `low` steps fit, for `high` they do not
            while high - low > 1:
                mid = (low + high) // 2
                if batch.num_new_blocks(mid, block_size) <= num_free:
                    low = mid
                else:
                    high = mid
            num_steps = low
        return self._run(batch, num_steps, soonest)

    def _head_fits(self, batch_size: int, budget: int, num_free: int) -> bool:
        """Whether schedule() would admit the waiting head now."""
        scheduler = self.scheduler
        bm = scheduler.block_manager
        if budget <= 0 or batch_size >= scheduler.max_num_seqs:  # before looking up the head's cached prefix
            return False
        head = scheduler.waiting[0]
        computed_ids = scheduler.computed_blocks(head) if bm.enable_caching else ()
        computed = head.num_computed_tokens + len(computed_ids) * bm.block_size
        head_new = head.num_tokens - computed
        if budget < head_new:
            head_new = budget
        return bm.num_blocks_to_allocate(head.request_id, computed + head_new, computed_ids) <= num_free

    def _run(self, batch: DecodeBatch, num_steps: int, soonest: int, admits: bool = False) -> DecodeRunPlan:
        departures = batch.departures(num_steps, self.scheduler.running) if soonest < num_steps else []
        return DecodeRunPlan(len(batch.lasts), batch.context_len_sum(), num_steps, soonest, departures, admits)

    def _join(self, batch: DecodeBatch) -> bool:
        """Add the running requests admitted since the batch last grew; False (adding none of the rest)
        at one that is not decoding or that a sampled token could stop."""
        bm = self.scheduler.block_manager
        tables, block_size = bm.block_tables, bm.block_size
        for request in self.scheduler.running[len(batch):]:
            if (len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens != 1
                    or _may_stop(request)):
                return False
            batch.join(request, len(tables[request.request_id]) * block_size)
        return True

    def schedule(self, run: DecodeRunPlan, num_steps: int, now: float) -> StepPlan | None:
        """Take the run's first num_steps (<= run.num_steps) steps: allocate the batch's blocks in the
        order single steps would, and return a StepPlan of what the first step schedules besides the
        batch's decodes: the waiting requests it admits, as schedule() would. None when it admits nobody
        for certain (plan() found the waiting head could not join, or nobody waits): a run of several steps,
        or one not planned to admit. The ids finished meanwhile then wait for the next StepPlan."""
        scheduler = self.scheduler
        bm = scheduler.block_manager
        if num_steps > 1:
            self._before = (bm.num_blocks - bm.num_free_blocks, bm.num_reserved_unused_slots())
        if scheduler.contiguous:
            self._alloc_steps = ()
        else:
            batch = self._batch
            assert batch is not None  # plan() made it
            positions, self._alloc_steps = batch.take_blocks(num_steps, bm.block_size)
            if positions:
                running = scheduler.running
                if bm.append_blocks([running[index].request_id for index in positions]) is None:
                    raise RuntimeError("DecodeRunPlanner.schedule ran out of blocks: num_steps is too large")
        scheduler.note_decode_steps(num_steps)
        if not run.admits:
            return None
        return scheduler.admit(now, scheduler.config.max_num_batched_tokens - run.batch_size)

    def advance(self, run: DecodeRunPlan, token_id: int, step_end_times: list[float]) -> list[Request]:
        """Apply the len(step_end_times) steps taken by schedule() (its plan's requests go through
        update_from_output afterwards): every member sampled token_id at every step, stamped with that
        step's end; the tokens are written to a request when it leaves the batch or at settle(). Retires
        those reaching max_tokens and returns them, in the order single steps would retire them."""
        batch = self._batch
        assert batch is not None  # plan() made it
        if token_id != batch.token_id:
            self._write_tokens()
            batch.token_id = token_id
        soonest_last = batch.step + run.soonest  # members only left since the run was planned
        num_steps = len(step_end_times)
        first = batch.step  # the step before the run's first
        batch.add_steps(step_end_times)
        scheduler = self.scheduler
        bm = scheduler.block_manager
        departures = self._departures = []
        if soonest_last > batch.step:  # everyone took part in every step
            bm.record_decode_tokens(num_steps * len(batch.lasts))
            return []
        finishing = batch.finishing(soonest_last)
        step, running, end_times, base = batch.step, scheduler.running, batch.end_times, batch.base + 1
        bm.record_decode_tokens(num_steps * len(batch.lasts) - sum(step - last for last, _ in finishing))
        finished = [running[index] for _, index in finishing]
        for (last, _), request in zip(finishing, finished):
            request.times.finished = end_times[last - base]
            batch.leave(running.index(request), request, bm)
            num_free, num_unused = bm.num_free_blocks, bm.num_reserved_unused_slots()
            scheduler.finish_request(request, RequestStatus.FINISHED_LENGTH)
            departures.append((last - first, bm.num_free_blocks - num_free, num_unused - bm.num_reserved_unused_slots()))
        return finished

    def run_states(self, run: DecodeRunPlan, start: float, step_end_times: list[float]) -> RunStates:
        """The scheduler's states after each step of the run advance() took last (of more than one step,
        from start), summed up as its single steps' StepStats would give them."""
        bm = self.scheduler.block_manager
        num_used_blocks, num_unused_slots = self._before
        return run_states(start, step_end_times, run.batch_size, num_used_blocks, num_unused_slots, bm.num_blocks,
                          bm.block_size, self._alloc_steps, self._departures)

    def settle(self) -> None:
        """Write every member's outstanding tokens and timestamps, and end the batch (the next run
        starts a new one). Before anything but the planner reads or changes the running requests."""
        if self._batch is not None:
            self._write_tokens()
            self._batch = None

    def _write_tokens(self) -> None:
        batch, bm = self._batch, self.scheduler.block_manager
        assert batch is not None
        if batch.num_unsettled_tokens:
            for index, request in enumerate(self.scheduler.running[:len(batch)]):
                batch.settle(index, request, bm)


def _may_stop(request: Request) -> bool:
    """Whether a sampled token could stop request (Scheduler._stop_token_status)."""
    params = request.sampling_params
    return bool(request.eos_token_ids and not params.ignore_eos or params.stop_token_ids)
