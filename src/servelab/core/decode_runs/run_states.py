"""What the StepStats of a decode run's single steps would have said about the scheduler's state, summed up.

A single step's StepStats gives the state after it: running requests, KV blocks in use, reserved slots
not filled yet. A run (core/decode_runs/planner.py) emits one StepStats for many steps, and inside it those states
change at known steps: a member finishing at the end of a step frees its blocks and its unfilled slots, a
block allocated in a step is held from then on, and every step fills one slot per member. RunStates holds
their means over the run's steps, weighted by the steps' durations, and their peaks: what the meters
would compute from the single steps. run_states() gets them from those events in closed form, at a cost
per event rather than per step.
"""
from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, fields
from itertools import groupby
from operator import itemgetter


@dataclass(slots=True)
class RunStates:
    mean_running: float
    mean_kv_usage: float
    mean_reserved_unused_slots: float
    peak_running: int  # after the run's first step: nobody joins a run, so the most
    peak_running_s: float  # seconds of the steps after which peak_running requests ran
    peak_kv_usage: float


FIELDS = tuple(f.name for f in fields(RunStates))  # not __slots__: a compiled class has none


def run_states(start: float, ends: list[float], num_running: int, num_used_blocks: int, num_unused_slots: int,
               num_blocks: int, block_size: int, alloc_steps: Sequence[int],
               departures: list[tuple[int, int, int]]) -> RunStates:
    """A run of len(ends) steps from start, step k ending at ends[k - 1]. Before it: num_running members,
    num_used_blocks of num_blocks in use, num_unused_slots reserved and not filled. alloc_steps: the step
    (1, 2, ...) each block the run allocated was taken in, ascending. departures: (step, blocks freed,
    unfilled slots freed) of each member that finished at the end of that step, by step."""
    num_steps, end = len(ends), ends[-1]
    duration = end - start
    starts = [0.0, start, *ends]  # starts[k]: when step k started (from k = 1)
    # Seconds from a step's start to the run's end: the steps whose states show a change made in that step.
    allocated = sum(map(end.__sub__, map(starts.__getitem__, alloc_steps)))
    # Slots filled: every member fills one in each step it takes part in, up to its departure.
    filled = num_running * (num_steps * end - (sum(starts) - end))
    running = num_running * duration
    used = num_used_blocks * duration + allocated
    unused = num_unused_slots * duration + block_size * allocated
    if not departures:
        return RunStates(num_running, used / (num_blocks * duration), (unused - filled) / duration, num_running,
                         duration, (num_used_blocks + len(alloc_steps)) / num_blocks)
    first_departures, peak_running_end = 0, end
    for step, num_freed_blocks, num_freed_slots in departures:
        held = end - starts[step]
        running -= held
        used -= num_freed_blocks * held
        unused -= num_freed_slots * held
        # the steps after this one, in which it fills no slot
        filled -= (num_steps - step) * end - sum(starts[step + 1:-1])
        if step == 1:
            first_departures += 1
        elif peak_running_end == end:
            peak_running_end = starts[step]
    return RunStates(running / duration, used / (num_blocks * duration), (unused - filled) / duration,
                     num_running - first_departures, peak_running_end - start,
                     _peak_used(num_used_blocks, alloc_steps, departures) / num_blocks)


def _peak_used(num_used_blocks: int, alloc_steps: Sequence[int], departures: list[tuple[int, int, int]]) -> int:
    """Most blocks in use after any step. Between departures the count only grows, so the most is after a
    step with departures, after the step before one, or after the last step."""
    peak = freed = 0
    for step, group in groupby(departures, key=itemgetter(0)):
        if step > 1:
            used = num_used_blocks + bisect_right(alloc_steps, step - 1) - freed
            if used > peak:
                peak = used
        freed += sum(num_freed_blocks for _, num_freed_blocks, _ in group)
        used = num_used_blocks + bisect_right(alloc_steps, step) - freed
        if used > peak:
            peak = used
    used = num_used_blocks + len(alloc_steps) - freed
    return used if used > peak else peak
