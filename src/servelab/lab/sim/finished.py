"""A finished request as a simulation keeps it: what the metrics and meters read, and nothing else.

A day of traffic is hundreds of thousands of requests; the engine's Request carries their token ids
(placeholders in the lab) and a Python float per output token. Once a request is done the simulator
keeps its counts and timestamps, with the token times as a packed array of the same floats.
"""
from __future__ import annotations

from array import array
from dataclasses import dataclass

from servelab.core.request import Request, RequestTimes


@dataclass(frozen=True, slots=True)
class SimulatedRequest:
    request_id: str
    arrival_time: float
    num_prompt_tokens: int
    num_output_tokens: int
    num_preemptions: int
    times: RequestTimes  # token_times is an array("d")

    @classmethod
    def of(cls, request: Request) -> "SimulatedRequest":
        t = request.times
        times = RequestTimes(t.arrival, t.first_scheduled, t.first_token, array("d", t.token_times), t.finished)
        return cls(request.request_id, request.arrival_time, request.num_prompt_tokens, request.num_output_tokens,
                   request.num_preemptions, times)
