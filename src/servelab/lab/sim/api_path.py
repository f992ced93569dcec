"""What a benchmark client sees: the engine's request timestamps plus the work outside the engine's steps.

Three terms, all off the GPU's path, so they move timestamps without slowing any step:
- the API server's own work per request (HTTP, tokenization, the first chunk before the first token;
  detokenization and the closing chunk after the last), from the efficiency's api_*_overhead_s;
- multi-step scheduling (vLLM's --num-scheduler-steps N): a request arriving while a block of N decode
  steps runs waits for the block to end. The simulator already makes it wait for the step in flight,
  so the extra wait is the rest of the block: on average (N - 1) / 2 decode steps, priced at the
  request's own time per output token;
- a disaggregated deployment whose proxy streams the answer from the decode instance
  (first_token_from_decode): the client sees the first token when the decode instance emits it, after
  the KV handoff and the decode instance's first step, and every later token one step later;
- asynchronous output processing (vLLM V0, async_output): a step's tokens are processed while the next
  step runs and returned when it ends: the first token (and, approximately, every one before the last)
  reaches the client when the instance's step after it ends, the last when the step after the last
  ends (at once when the instance has nothing more to run).
"""
from __future__ import annotations

from array import array
from typing import Iterator, Sequence

import numpy as np

from servelab.lab.sim.deployment import Deployment
from servelab.lab.sim.finished import SimulatedRequest
from servelab.metrics.request_stats import RequestTiming


class ClientTokenTimes(Sequence[float]):
    """A request's token times as its client sees them: the engine's, each `before` later and the last
    `after` later. Kept as the engine's times and the two shifts (a day's tokens are too many to copy);
    every value, and the array numpy makes of them, is the float a shifted copy would hold."""

    __slots__ = ("engine_times", "before", "after")

    def __init__(self, engine_times: Sequence[float], before: float, after: float) -> None:
        self.engine_times, self.before, self.after = engine_times, before, after

    def __len__(self) -> int:
        return len(self.engine_times)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        times = self.engine_times
        if index < 0:
            index += len(times)
        return times[index] + (self.after if index == len(times) - 1 else self.before)

    def __iter__(self) -> Iterator[float]:
        return iter(self.__array__().tolist())

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        shifted = np.array(self.engine_times, dtype=np.float64)
        shifted += self.before
        shifted[-1] = self.engine_times[-1] + self.after
        return shifted if dtype is None else shifted.astype(dtype)

    def __eq__(self, other) -> bool:
        if isinstance(other, (Sequence, array)):
            return list(self) == list(other)
        return NotImplemented


def client_timings(deployment: Deployment, requests: list[SimulatedRequest]) -> list[RequestTiming]:
    e, steps = deployment.efficiency, deployment.num_scheduler_steps
    via_decode, late = deployment.first_token_from_decode, deployment.async_output
    if not e.api_ttft_overhead_s and not e.api_final_overhead_s and steps == 1 and not via_decode and not late:
        return [RequestTiming(r.num_prompt_tokens, r.num_output_tokens, r.arrival_time, r.times.first_token,
                              r.times.finished, r.times.token_times, r.times.first_scheduled) for r in requests]
    timings = []
    for r in requests:
        t = r.times
        before = e.api_ttft_overhead_s
        times = t.token_times
        first = 1 if via_decode and len(times) > 1 else 0  # the second token: the decode instance's first step
        if first:
            before += times[1] - times[0]
        # the wait for the block in flight; without mixed batches the scheduler simulates its passes
        if steps > 1 and deployment.mixed_batches and r.num_output_tokens > 1:
            before += (steps - 1) / 2 * (t.finished - t.first_token) / (r.num_output_tokens - 1)
        after = before + e.api_final_overhead_s
        if late and r.async_delays:  # asynchronous output: delivered when the instance's next step ends
            before += r.async_delays[0]
            after += r.async_delays[1]
        token_times = ClientTokenTimes(t.token_times, before, after) if len(t.token_times) else ()
        timings.append(RequestTiming(r.num_prompt_tokens, r.num_output_tokens, r.arrival_time, t.first_token + before,
                                     t.finished + after, token_times, t.first_scheduled))
    return timings
