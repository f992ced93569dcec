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
from bisect import bisect_left
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

    @classmethod
    def of(cls, request: Request, timeline: array) -> "SimulatedRequest":
        """request, finished on the instance whose step ends timeline holds."""
        t = request.times
        times = RequestTimes(t.arrival, t.first_scheduled, t.first_token, compact_token_times(t.token_times, timeline),
                             t.finished)
        return cls(request.request_id, request.arrival_time, request.num_prompt_tokens, request.num_output_tokens,
                   request.num_preemptions, times)
