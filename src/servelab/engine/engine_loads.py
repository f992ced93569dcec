"""Which data-parallel engine core takes the next request: the least loaded by waiting + running, ties to
the lowest index (the lab's least-loaded router, on the real engines' numbers)."""
from __future__ import annotations

from servelab.metrics.events import EngineState


class EngineLoads:
    """Per engine core: waiting + running as of its last reported EngineState, plus the engine-core
    requests sent to it that it has not yet taken or refused (the state cannot count those yet)."""

    def __init__(self, num_engines: int) -> None:
        self._reported = [0] * num_engines
        self._in_transit = [0] * num_engines

    def load(self, index: int) -> int:
        return self._reported[index] + self._in_transit[index]

    def pick(self, among: list[int] | None = None) -> int:
        """The least loaded core (of `among`, e.g. the prefill instances; of all when None)."""
        return min(range(len(self._reported)) if among is None else among, key=self.load)

    def sent(self, index: int, num_requests: int) -> None:
        self._in_transit[index] += num_requests

    def answered(self, index: int, num_requests: int) -> None:
        """The core took or refused them: from now on its state counts them (or they are gone)."""
        self._in_transit[index] -= num_requests

    def report(self, index: int, state: EngineState) -> None:
        self._reported[index] = state.num_waiting + state.num_running
