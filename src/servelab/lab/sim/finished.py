"""A finished request as a simulation keeps it: what the metrics and meters read, and nothing else.

A day of traffic is hundreds of thousands of requests; the engine's Request carries their token ids
(placeholders in the lab) and a Python float per output token. Once a request is done the simulator
keeps its counts and timestamps. A request that made one token a step on one instance (the usual case:
no preemption, no KV handoff) has as token times a slice of that instance's step-end timeline
(StepLog.timeline), the same floats shared with every request of its batch; any other keeps its own
packed array.
"""
from __future__ import annotations

import struct
from array import array
from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from servelab.core.request import Request, RequestTimes


class TimelineTimes(Sequence[float]):
    """timeline[start:stop], read in place."""

    __slots__ = ("timeline", "start", "stop")

    def __init__(self, timeline: array, start: int, stop: int) -> None:
        self.timeline, self.start, self.stop = timeline, start, stop

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index):
        if isinstance(index, slice):
            return self.timeline[self.start:self.stop][index].tolist()
        if not -len(self) <= index < len(self):
            raise IndexError(index)
        return self.timeline[self.start + index % len(self)]

    def __iter__(self) -> Iterator[float]:
        return iter(self.timeline[self.start:self.stop])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array(self.timeline[self.start:self.stop], dtype=dtype or np.float64)

    def __eq__(self, other) -> bool:
        if isinstance(other, (Sequence, array)):
            return list(self) == list(other)
        return NotImplemented


def compact_token_times(token_times: list[float], timeline: array) -> Sequence[float]:
    """token_times as a slice of timeline when they are one (consecutive steps), else as a packed array."""
    n = len(token_times)
    if n:
        start = bisect_left(timeline, token_times[0])
        if timeline[start:start + n].tobytes() == struct.pack(f"{n}d", *token_times):  # the same floats
            return TimelineTimes(timeline, start, start + n)
    return array("d", token_times)


@dataclass(slots=True)
class SimulatedRequest:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    times: RequestTimes  # token_times: a TimelineTimes or an array("d")
    # Asynchronous output processing only (Deployment.async_output): how long after the client's first
    # token and after the last token the instance's next step ended, when the outputs reached the client.
    async_delays: tuple[float, float] | None = None

    @classmethod
    def of(cls, request: Request, timeline: array, async_from: int | None = None,
           busy: bool = False) -> "SimulatedRequest":
        """request, finished on the instance whose step ends timeline holds. async_from: the index of the
        token the client sees first, when outputs are processed asynchronously; busy: the instance has
        more work, so a step follows the last one. Its RequestTimes becomes the simulated request's, token
        times compacted (nothing writes a finished request's times)."""
        times = request.times
        token_times = times.token_times
        delays = None if async_from is None else next_step_delays(token_times, timeline, async_from, busy)
        times.token_times = compact_token_times(token_times, timeline)
        return cls(request.request_id, request.arrival_time, len(request.prompt_token_ids),
                   len(request.output_token_ids), request.num_preemptions, times, delays)


def next_step_delays(token_times: Sequence[float], timeline: array, first: int, busy: bool) -> tuple[float, float]:
    """(until the step after the client's first token ends, until the step after the last one ends), as
    asynchronous output processing delivers a step's tokens when the next step ends. A request with no
    token after its first has none after it (the engine flushes outputs when idle); the step after the
    last token is priced as long as the last step, and as nothing when the instance has no more work."""
    n = len(token_times)
    if n <= first + 1:
        return 0.0, 0.0
    t0 = token_times[first]
    i = bisect_right(timeline, t0)
    after_first = (timeline[i] if i < len(timeline) else token_times[first + 1]) - t0
    last = token_times[-1]
    j = bisect_left(timeline, last)
    previous = timeline[j - 1] if j > 0 else token_times[-2]
    return after_first, (last - previous if busy else 0.0)
