"""The engine's notion of time: the wall clock for real runs, a virtual one for the lab."""
from __future__ import annotations

import time


class WallClock:
    def now(self) -> float:
        return time.perf_counter()

    def advance(self, seconds: float) -> None:
        """Real steps take real time; nothing to do."""


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self._now = start

    def now(self) -> float:
        return self._now

    def advance(self, seconds: float) -> None:
        if seconds < 0:
            raise ValueError("time cannot go backwards")
        self._now += seconds

    def advance_to(self, t: float) -> None:
        if t > self._now:  # max(self._now, t), at every simulated step
            self._now = t
