"""Multi-step decode (vLLM's num_scheduler_steps): one scheduling decision for a run of decode steps.

When every running request is decoding and nothing can change the batch (no admission, no block
shortage), the next k schedule() calls are known in advance: each plans the batch's unfinished
requests for one token each. A DecodeRun describes those k steps (the batch, its context lengths,
who finishes when), which is all a cost model needs to price them, so the simulator takes such a run
in one go. A one-step run may also admit waiting requests, exactly as schedule() would (they come back
as an ordinary StepPlan). Tokens, timestamps, block ids and pool state are identical to single steps
(tests/lab/test_multi_step.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from servelab.core.plan import StepPlan
from servelab.core.request import Request, RequestStatus


@dataclass
class DecodeRun:
    """Up to num_steps decode steps of batch; valid until the scheduler's state next changes."""
    batch: list[Request]  # the running requests, in order
    num_steps: int
    computed: list[int]  # num_computed_tokens of each at the start
    remaining: list[int]  # output tokens each may still generate (it leaves the batch after them)
    slack: list[int]  # free token slots in each one's last block (paged allocation)
    context_len_sum: int  # sum of step 1's context lengths (num_computed_tokens + 1 each)


class MultiStepDecodeMixin:
    """Part of Scheduler; uses its queues, block manager and admission."""

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
        contiguous = self.config.contiguous
        bm = self.block_manager
        tables, block_size = bm.block_tables, bm.block_size
        computed, remaining, slack = [], [], []
        for request in running:
            num_output = len(request.output_token_ids)
            done = request.num_computed_tokens
            if len(request.prompt_token_ids) + num_output - done != 1:
                return None
            computed.append(done)
            remaining.append(request.max_tokens - num_output)
            if not contiguous:
                slack.append(len(tables[request.request_id]) * block_size - done)
        run = DecodeRun(list(running), limit, computed, remaining, slack, sum(computed) + batch_size)
        if contiguous:
            run.num_steps = min(limit, max(remaining))  # reservations cover max_tokens; no admission till all finish
            return run
        if slack.count(0) > bm.num_free_blocks:
            return None  # the next step preempts someone
        budget = self.config.max_num_batched_tokens - batch_size
        if self.waiting:
            head = self.waiting[0]
            head_new = min(head.num_tokens - head.num_computed_tokens, budget)
            # Free blocks only shrink until someone finishes, so a head that does not fit now will not.
            if (budget > 0 and batch_size < self.max_num_seqs and bm.num_new_blocks_needed(
                    head.request_id, head.num_computed_tokens + head_new) <= bm.num_free_blocks):
                run.num_steps = 1
                return run
            run.num_steps = min(limit, min(remaining))
        else:
            run.num_steps = min(limit, max(remaining))
        # Blocks freed by finishes join the back of the free list, behind all the blocks counted here,
        # so the run's allocations get the same ids as single steps would.
        if _num_new_blocks(run, run.num_steps, block_size) > bm.num_free_blocks:
            low, high = 1, run.num_steps  # blocks for `low` steps fit, for `high` they do not
            while high - low > 1:
                mid = (low + high) // 2
                if _num_new_blocks(run, mid, block_size) <= bm.num_free_blocks:
                    low = mid
                else:
                    high = mid
            run.num_steps = low
        return run

    def schedule_decode_run(self, run: DecodeRun, num_steps: int, now: float) -> StepPlan:
        """Take the run's first num_steps (<= run.num_steps) steps: allocate the batch's blocks in the
        order single steps would, and return a StepPlan of what the first step schedules besides the
        batch's decodes: the waiting requests it admits, as schedule() would (only when num_steps is 1)."""
        plan = StepPlan(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        if self.config.contiguous:
            return plan
        bm = self.block_manager
        block_size = bm.block_size
        allocations = []  # (step, index in batch) of every block allocation the single steps would make
        last_tokens = []
        for index, (done, left, free_slots) in enumerate(zip(run.computed, run.remaining, run.slack)):
            last = num_steps if left > num_steps else left
            first = free_slots + 1
            while first <= last:
                allocations.append((first, index))
                first += block_size
            last_tokens.append(done + last)
        request_ids = [r.request_id for r in run.batch]
        if allocations:
            allocations.sort()
            if bm.append_blocks([request_ids[index] for _, index in allocations]) is None:
                raise RuntimeError("schedule_decode_run ran out of blocks: num_steps is too large")
        # what each request's last single step's allocate_slots call would have noted
        bm.record_tokens_batch(request_ids, last_tokens)
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
        updated = []
        finishing = []  # (step, index in batch, request, status)
        num_steps = len(step_end_times)
        requests = self.requests
        first_end = step_end_times[0]
        for index, (request, left) in enumerate(zip(run.batch, run.remaining)):
            request_id = request.request_id
            if requests.get(request_id) is not request:
                continue  # aborted meanwhile
            token_ids = sampled_token_ids[request_id]
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
            if status is None and count == left:
                status = RequestStatus.FINISHED_LENGTH
            if status is not None:
                times.finished = step_end_times[count - 1]
                finishing.append((count, index, request, status))
            updated.append(request)
        if self.config.contiguous:
            self.block_manager.record_tokens_batch([r.request_id for r in updated],
                                                   [r.num_computed_tokens for r in updated])
        # single steps retire requests step by step, in batch order within a step; the free list's order follows
        for _, _, request, status in sorted(finishing, key=lambda f: f[:2]):
            self.finish_request(request, status)
        return updated


def _num_new_blocks(run: DecodeRun, num_steps: int, block_size: int) -> int:
    """Blocks the batch allocates in num_steps decode steps: each request until its last step."""
    total = 0
    for free_slots, left in zip(run.slack, run.remaining):
        steps = num_steps if num_steps < left else left
        if steps > free_slots:
            total += -(-(steps - free_slots) // block_size)
    return total
