"""Multi-step decode (vLLM's num_scheduler_steps): one scheduling decision for a run of decode steps.

When every running request is decoding and nothing can change the batch (no admission, no block
shortage), the next k schedule() calls are known in advance: each plans the batch's unfinished
requests for one token each. A DecodeRun describes those k steps (the batch, its context lengths,
who finishes when), which is all a cost model needs to price them, so the simulator takes such a run
in one go. A one-step run may also admit waiting requests, exactly as schedule() would (they come back
as an ordinary StepPlan). Tokens, timestamps, block ids and pool state are identical to single steps
(tests/lab/test_multi_step.py).

Consecutive runs share one DecodeBatch, which counts each request's progress in the batch's own steps,
so planning and taking a run cost about the same whatever the batch size. update_from_decode_run writes
each run's tokens at once; advance_decode_run (the simulator's) writes a request's tokens, timestamps
and KV token count only when it leaves the batch or the scheduler next needs them (settling).
"""
from __future__ import annotations

from dataclasses import dataclass

from servelab.core.block_manager import BlockManager
from servelab.core.plan import StepPlan
from servelab.core.request import Request, RequestStatus


class DecodeBatch:
    """The running requests (Scheduler.running[:len(batch)]) while they decode, in the batch's steps:
    step s is its s-th decode step, ending at end_times[s - 1]. Member i has the tokens of its steps up
    to settled[i] written (to its Request and the block manager's token count), makes one token a step
    until step lasts[i] (its max_tokens) and, with paged allocation, next needs a block in step allocs[i].
    The steps it has not settled all sampled token_id."""

    def __init__(self) -> None:
        self.step = 0
        self.end_times: list[float] = []
        self.settled: list[int] = []
        self.lasts: list[int] = []
        self.allocs: list[int] = []
        self.token_id: int | None = None
        # sums over members of num_computed_tokens - settled (constant while it decodes) and of settled
        self.offset_sum = 0
        self.settled_sum = 0
        self.num_may_stop = 0  # members a sampled token could stop (EOS or stop token ids)

    def __len__(self) -> int:
        return len(self.settled)

    @property
    def num_unsettled_tokens(self) -> int:
        return len(self.settled) * self.step - self.settled_sum

    def context_len_sum(self) -> int:
        """Sum of the members' context lengths in the next step (num_computed_tokens + 1 each)."""
        return self.offset_sum + len(self.settled) * (self.step + 1)

    def join(self, request: Request, num_table_slots: int) -> None:
        step, computed = self.step, request.num_computed_tokens
        self.settled.append(step)
        self.lasts.append(step + request.max_tokens - len(request.output_token_ids))
        self.allocs.append(step + num_table_slots - computed + 1)
        self.offset_sum += computed - step
        self.settled_sum += step
        self.num_may_stop += _may_stop(request)

    def leave(self, index: int, request: Request) -> None:
        """Settle member index and drop it. Its KV token count is not written: the request is leaving
        the block manager too, which drops the count it has (the settled one is never read)."""
        self.settle(index, request, None)
        settled = self.settled[index]
        self.offset_sum -= request.num_computed_tokens - settled
        self.settled_sum -= settled
        if self.num_may_stop:
            self.num_may_stop -= _may_stop(request)
        del self.settled[index], self.lasts[index], self.allocs[index]

    def settle(self, index: int, request: Request, block_manager: BlockManager | None) -> None:
        """Write member index's tokens up to the current step (or its last), and its KV token count
        to block_manager."""
        settled, last = self.settled[index], self.lasts[index]
        upto = self.step if self.step < last else last
        count = upto - settled
        if count <= 0:
            return
        times = request.times
        if times.first_token is None:
            times.first_token = self.end_times[settled]
        times.token_times.extend(self.end_times[settled:upto])
        request.output_token_ids.extend([self.token_id] * count)
        request.num_computed_tokens += count
        if block_manager is not None:
            block_manager.record_tokens(request.request_id, request.num_computed_tokens)
        self.settled[index] = upto
        self.settled_sum += count

    def num_new_blocks(self, num_steps: int, block_size: int) -> int:
        """Blocks the members allocate in the next num_steps steps (each until its last)."""
        end, total = self.step + num_steps, 0
        for alloc, last in zip(self.allocs, self.lasts):
            stop = end if end < last else last
            if alloc <= stop:
                total += 1 + (stop - alloc) // block_size
        return total

    def take_blocks(self, num_steps: int, block_size: int) -> list[int]:
        """Positions of the members needing a new block in the next num_steps steps, one per block, in
        the order single steps would allocate them (by step, then batch order); moves allocs past them."""
        allocs, lasts = self.allocs, self.lasts
        if num_steps == 1:  # everyone takes part in the next step
            positions = _positions(allocs, self.step + 1)
            for index in positions:
                allocs[index] += block_size
            return positions
        end = self.step + num_steps
        if num_steps <= block_size:  # each allocates at most once (allocs are past the batch's step)
            positions = []
            for index in _ordered(allocs):
                alloc = allocs[index]
                if alloc > end:
                    break
                if alloc <= lasts[index]:
                    positions.append(index)
                    allocs[index] = alloc + block_size
            return positions
        found = []
        for index, last in enumerate(lasts):
            alloc = allocs[index]
            stop = end if end < last else last
            if alloc <= stop:
                while alloc <= stop:
                    found.append((alloc, index))
                    alloc += block_size
                allocs[index] = alloc
        found.sort()
        return [index for _, index in found]

    def finishing(self, low: int) -> list[tuple[int, int]]:
        """(last step, position) of the members whose last step the batch has reached, sorted: the
        order single steps retire them in. low: a step no member's last step precedes, at most the
        batch's step."""
        lasts, step = self.lasts, self.step
        if 8 * (step - low + 1) < len(lasts):  # few last steps to look for in a large batch
            return [(last, index) for last in range(low, step + 1) for index in _positions(lasts, last)]
        found = []
        for index in _ordered(lasts):
            last = lasts[index]
            if last > step:
                break
            found.append((last, index))
        return found


@dataclass
class DecodeRun:
    """Up to num_steps decode steps of batch; valid until the scheduler's state next changes."""
    batch: list[Request]  # the running requests, in order
    num_steps: int
    context_len_sum: int  # sum of step 1's context lengths (num_computed_tokens + 1 each)
    soonest: int  # fewest steps any of them takes part in before it finishes on length
    members: DecodeBatch

    def departures(self, num_steps: int) -> list[tuple[int, int]]:
        """(steps it takes part in, context length in step 1) of each request leaving the batch before
        step num_steps, by steps taken."""
        m = self.members
        step, lasts, found = m.step, m.lasts, []
        for index in _ordered(lasts):
            left = lasts[index] - step
            if left >= num_steps:
                break
            found.append((left, self.batch[index].num_computed_tokens - m.settled[index] + step + 1))
        return found


class MultiStepDecodeMixin:
    """Part of Scheduler; uses its queues, block manager, admission and _decode_batch."""

    def plan_decode_run(self, limit: int) -> DecodeRun | None:
        """The longest run (at most limit steps) that schedule() would certainly make of one decode
        token for every running request still unfinished, in order, with no preemption, if nothing
        arrives and no sampled token stops a request: no one is mid-prefill, the pool has the blocks,
        and (beyond the first step) nobody waiting can be admitted. Requests finishing on length leave
        the batch at their step; the run goes past a finish only when nobody waits (a finish could let
        the waiting head in). None when the next step needs a full schedule()."""
        running = self.running
        batch_size = len(running)
        if not running or limit < 1 or batch_size > self.config.max_num_batched_tokens:
            return None
        batch = self._decode_batch
        if batch is None or not batch.lasts:  # none yet, or everyone left: start counting steps afresh
            batch = self._decode_batch = DecodeBatch()
        if len(batch.lasts) < batch_size and not self._join_decode_batch(batch):
            return None
        step = batch.step
        run = DecodeRun(list(running), limit, batch.context_len_sum(), min(batch.lasts) - step, batch)
        if self.contiguous:
            run.num_steps = min(limit, max(batch.lasts) - step)  # reservations cover max_tokens; no admission till all finish
            return run
        bm = self.block_manager
        num_free = bm.num_free_blocks
        if batch_size > num_free and batch.allocs.count(step + 1) > num_free:
            return None  # the next step preempts someone
        budget = self.config.max_num_batched_tokens - batch_size
        if self.waiting:
            head = self.waiting[0]
            head_new = min(head.num_tokens - head.num_computed_tokens, budget)
            # Free blocks only shrink until someone finishes, so a head that does not fit now will not.
            if (budget > 0 and batch_size < self.max_num_seqs and bm.num_new_blocks_needed(
                    head.request_id, head.num_computed_tokens + head_new) <= num_free):
                run.num_steps = 1
                return run
            run.num_steps = min(limit, run.soonest)
        else:
            run.num_steps = min(limit, max(batch.lasts) - step)
        # Blocks freed by finishes join the back of the free list, behind all the blocks counted here,
        # so the run's allocations get the same ids as single steps would.
        block_size = bm.block_size
        if (batch_size * -(-run.num_steps // block_size) > num_free  # each needs at most one block per block_size steps
                and batch.num_new_blocks(run.num_steps, block_size) > num_free):
            low, high = 1, run.num_steps  # blocks for `low` steps fit, for `high` they do not
            while high - low > 1:
                mid = (low + high) // 2
                if batch.num_new_blocks(mid, block_size) <= num_free:
                    low = mid
                else:
                    high = mid
            run.num_steps = low
        return run

    def _join_decode_batch(self, batch: DecodeBatch) -> bool:
        """Add the running requests admitted since the batch last grew; False (adding none of the rest)
        at one that is not decoding."""
        tables, block_size = self.block_manager.block_tables, self.block_manager.block_size
        for request in self.running[len(batch):]:
            if len(request.prompt_token_ids) + len(request.output_token_ids) - request.num_computed_tokens != 1:
                return False
            batch.join(request, len(tables[request.request_id]) * block_size)
        return True

    def schedule_decode_run(self, run: DecodeRun, num_steps: int, now: float) -> StepPlan:
        """Take the run's first num_steps (<= run.num_steps) steps: allocate the batch's blocks in the
        order single steps would, and return a StepPlan of what the first step schedules besides the
        batch's decodes: the waiting requests it admits, as schedule() would (only when num_steps is 1)."""
        plan = StepPlan(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        if self.contiguous:
            return plan
        bm = self.block_manager
        positions = self._decode_batch.take_blocks(num_steps, bm.block_size)
        if positions:
            running = self.running
            if bm.append_blocks([running[index].request_id for index in positions]) is None:
                raise RuntimeError("schedule_decode_run ran out of blocks: num_steps is too large")
        if num_steps == 1:
            self._admit_continuous(plan, self.config.max_num_batched_tokens - len(run.batch), now)
        return plan

    def update_from_decode_run(self, run: DecodeRun, sampled_token_ids: dict[str, list[int]],
                               step_end_times: list[float]) -> list[Request]:
        """Apply the len(step_end_times) steps taken by schedule_decode_run (its plan's requests go
        through update_from_output afterwards): each request gets one token per step, stamped with
        that step's end. A stop token retires its request at that step and the tokens sampled after it
        are dropped (as vLLM's multi-step scheduling does). Returns the batch's requests still known to
        the scheduler (finished ones included)."""
        batch = self._decode_batch
        self._settle_decode_batch()
        start = batch.step
        num_steps = len(step_end_times)
        batch.step += num_steps
        batch.end_times += step_end_times
        settled, lasts = batch.settled, batch.lasts
        updated = []
        finishing = []  # (step, index in batch, request, status)
        first_end = step_end_times[0]
        for index, request in enumerate(self.running[:len(batch)]):  # those aborted meanwhile have left
            token_ids = sampled_token_ids[request.request_id]
            left = lasts[index] - start
            count = num_steps if left > num_steps else left
            status = None
            if request.eos_token_ids or request.sampling_params.stop_token_ids:
                for position in range(count):
                    status = self._stop_token_status(request, token_ids[position])
                    if status is not None:
                        count = position + 1
                        break
            request.num_computed_tokens += count
            request.output_token_ids.extend(token_ids if count == len(token_ids) else token_ids[:count])
            times = request.times
            if times.first_token is None:
                times.first_token = first_end
            times.token_times.extend(step_end_times if count == num_steps else step_end_times[:count])
            settled[index] = start + count
            batch.settled_sum += count
            if status is None and count == left:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                lasts[index] = start + count
                times.finished = step_end_times[count - 1]
                finishing.append((count, index, request, status))
            updated.append(request)
        self.block_manager.record_tokens_batch([r.request_id for r in updated],
                                               [r.num_computed_tokens for r in updated])
        # single steps retire requests step by step, in batch order within a step; the free list's order follows
        for _, _, request, status in sorted(finishing, key=lambda f: f[:2]):
            self.finish_request(request, status)
        return updated

    def advance_decode_run(self, run: DecodeRun, token_id: int, step_end_times: list[float]) -> list[Request]:
        """update_from_decode_run when every request sampled token_id at every step, and no sampled token
        can stop any of them (the simulator's case): the tokens are written when each request is settled.
        Returns the requests it retired (finished on length), in the order it retired them."""
        batch = self._decode_batch
        if batch.num_may_stop:
            raise ValueError("advance_decode_run needs a batch that no token stops; use update_from_decode_run")
        if token_id != batch.token_id:
            self._settle_decode_batch()
            batch.token_id = token_id
        soonest_last = batch.step + run.soonest  # members only left since the run was planned
        batch.step += len(step_end_times)
        batch.end_times += step_end_times
        if soonest_last > batch.step:
            return []
        finishing = batch.finishing(soonest_last)
        running, end_times = self.running, batch.end_times
        finished = [running[index] for _, index in finishing]
        for (last, _), request in zip(finishing, finished):
            request.times.finished = end_times[last - 1]
            self.finish_request(request, RequestStatus.FINISHED_LENGTH)
        return finished

    def _settle_decode_batch(self) -> None:
        """Write every member's outstanding tokens (before anything reads them)."""
        batch = self._decode_batch
        if batch.num_unsettled_tokens:
            bm = self.block_manager
            for index, request in enumerate(self.running[:len(batch)]):
                batch.settle(index, request, bm)


def _may_stop(request: Request) -> bool:
    """Whether a sampled token could stop request (Scheduler._stop_token_status)."""
    params = request.sampling_params
    return bool(request.eos_token_ids and not params.ignore_eos or params.stop_token_ids)


def _ordered(values: list[int]) -> list[int]:
    """Indices of values by value, then index (a sort in C)."""
    return sorted(range(len(values)), key=values.__getitem__)


def _positions(values: list[int], value: int) -> list[int]:
    """Indices of value in values, ascending (list.count and list.index scan in C: far faster than a
    Python loop over a large batch)."""
    positions, index = [], -1
    for _ in range(values.count(value)):
        index = values.index(value, index + 1)
        positions.append(index)
    return positions
