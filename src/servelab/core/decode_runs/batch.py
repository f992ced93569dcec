"""The running requests while they take decode runs (core/decode_runs/planner.py), counted in the batch's own steps.

Consecutive runs share one DecodeBatch, so planning and taking a run cost about the same whatever the
batch size: a member's tokens and timestamps are written to its Request only when it leaves the batch
or the batch is settled, not at every run.
"""
from __future__ import annotations

from collections.abc import Sequence

from servelab.core.block_hash import cache_computed_blocks
from servelab.core.block_manager import BlockManager
from servelab.core.request import Request


class DecodeBatch:
    """Scheduler.running[:len(batch)] while they decode. Step s is the batch's s-th decode step, ending
    at end_times[s - 1 - base]. Member i has the tokens of its steps up to settled[i] written to its Request
    (and attributed to it in the block manager, which counted them when the run was taken), makes one token a step until step lasts[i] (its max_tokens) and, with paged allocation, next needs
    a block in step allocs[i]. The steps it has not settled all sampled token_id."""

    def __init__(self) -> None:
        self.step = 0
        # ends of steps base + 1, base + 2, ...: those before every member's settled step are dropped now
        # and then, as a batch that never empties would otherwise keep every step's end
        self.end_times: list[float] = []
        self.base = 0
        self._trim_at = _TRIM_STEPS
        self.settled: list[int] = []
        self.lasts: list[int] = []
        self.allocs: list[int] = []
        self.token_id: int | None = None
        # sums over members of num_computed_tokens - settled (constant while it decodes) and of settled
        self.offset_sum = 0
        self.settled_sum = 0

    def __len__(self) -> int:
        return len(self.settled)

    @property
    def num_unsettled_tokens(self) -> int:
        return len(self.settled) * self.step - self.settled_sum

    def context_len_sum(self) -> int:
        """Sum of the members' context lengths in the next step (num_computed_tokens + 1 each)."""
        return self.offset_sum + len(self.settled) * (self.step + 1)

    def add_steps(self, step_end_times: list[float]) -> None:
        """The batch took len(step_end_times) more steps, ending at those times."""
        self.step += len(step_end_times)
        end_times = self.end_times
        end_times += step_end_times
        if len(end_times) > self._trim_at:
            drop = min(self.settled) - self.base if self.settled else len(end_times)
            del end_times[:drop]
            self.base += drop
            self._trim_at = len(end_times) + _TRIM_STEPS

    def join(self, request: Request, num_table_slots: int) -> None:
        step, computed = self.step, request.num_computed_tokens
        self.settled.append(step)
        self.lasts.append(step + request.max_tokens - len(request.output_token_ids))
        self.allocs.append(step + num_table_slots - computed + 1)
        self.offset_sum += computed - step
        self.settled_sum += step

    def leave(self, index: int, request: Request, block_manager: BlockManager) -> None:
        """Settle member index and drop it."""
        self.settle(index, request, block_manager)
        settled = self.settled[index]
        self.offset_sum -= request.num_computed_tokens - settled
        self.settled_sum -= settled
        del self.settled[index], self.lasts[index], self.allocs[index]

    def settle(self, index: int, request: Request, block_manager: BlockManager) -> None:
        """Write member index's tokens and timestamps up to the current step (or its last), and
        attribute its KV token count to it in block_manager."""
        settled, last = self.settled[index], self.lasts[index]
        upto = self.step if self.step < last else last
        count = upto - settled
        if count <= 0:
            return
        times, base = request.times, self.base
        if times.first_token is None:
            times.first_token = self.end_times[settled - base]
        times.token_times.extend(self.end_times[settled - base:upto - base])
        request.output_token_ids.extend([self.token_id] * count)  # type: ignore[list-item]  # set by advance()
        request.num_computed_tokens += count
        block_manager.attribute_tokens(request.request_id, request.num_computed_tokens)
        # Cached here rather than as each block fills: nobody looks up a running request's decode blocks
        # before they settle (a readmitted request settled all its own before it was preempted).
        cache_computed_blocks(block_manager, request)
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

    def take_blocks(self, num_steps: int, block_size: int) -> tuple[Sequence[int], Sequence[int]]:
        """Positions of the members needing a new block in the next num_steps steps, one per block, in
        the order single steps would allocate them (by step, then batch order), and the step of the
        next num_steps (1 to num_steps) each is allocated in; moves allocs past them."""
        allocs, lasts = self.allocs, self.lasts
        if num_steps == 1:  # everyone takes part in the next step
            positions = _positions(allocs, self.step + 1)
            for index in positions:
                allocs[index] += block_size
            return positions, [1] * len(positions)
        step = self.step
        end = step + num_steps
        if num_steps <= block_size:  # each allocates at most once (allocs are past the batch's step)
            positions, steps = [], []
            for index in _ordered(allocs):
                alloc = allocs[index]
                if alloc > end:
                    break
                if alloc <= lasts[index]:
                    positions.append(index)
                    steps.append(alloc - step)
                    allocs[index] = alloc + block_size
            return positions, steps
        found: list[tuple[int, int]] = []  # (step of the next num_steps, position)
        for index, last in enumerate(lasts):
            alloc = allocs[index]
            stop = end if end < last else last
            if alloc <= stop:
                while alloc <= stop:
                    found.append((alloc - step, index))
                    alloc += block_size
                allocs[index] = alloc
        if not found:
            return (), ()
        found.sort()
        found_steps, found_positions = zip(*found)
        return found_positions, found_steps

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

    def departures(self, num_steps: int, running: list[Request]) -> list[tuple[int, int]]:
        """(steps it takes part in, context length in the next step) of each member leaving the batch
        before num_steps more steps, by steps taken. running: the scheduler's running requests."""
        step, lasts, settled, found = self.step, self.lasts, self.settled, []
        for index in _ordered(lasts):
            left = lasts[index] - step
            if left >= num_steps:
                break
            found.append((left, running[index].num_computed_tokens - settled[index] + step + 1))
        return found


_TRIM_STEPS = 4096  # step ends kept beyond those members still need before trimming again


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
