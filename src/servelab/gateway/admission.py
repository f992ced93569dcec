"""Admission control: a bounded queue in front of the engine.

A request is queued from admission until its first token (waiting in the engine or being
prefilled); beyond --max-num-queued-requests or --max-queued-tokens new requests get 429 with
Retry-After. A request that alone exceeds a limit is admitted only into an empty queue (otherwise it
could never run). While draining for shutdown every new request gets 503.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from servelab.gateway.errors import queue_full, shutting_down

RETRY_AFTER_S = 1
_IDLE_POLL_S = 0.05


class AdmissionControl:
    def __init__(self, max_num_queued_requests: int, max_queued_tokens: int,
                 on_reject: Callable[[str], None] | None = None) -> None:
        self.max_num_queued_requests = max_num_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.num_queued = 0
        self.num_queued_tokens = 0
        self.num_in_flight = 0
        self.draining = False
        self._on_reject = on_reject or (lambda reason: None)

    def admit(self, token_counts: list[int]) -> "Ticket":
        """token_counts: prompt tokens to prefill for each engine request of one API call (all or none)."""
        if self.draining:
            self._on_reject("draining")
            raise shutting_down()
        num, tokens = len(token_counts), sum(token_counts)
        if self.num_queued and self.num_queued + num > self.max_num_queued_requests:
            self._on_reject("queue_full")
            raise queue_full(f"{self.num_queued} requests queued, limit {self.max_num_queued_requests}", RETRY_AFTER_S)
        if self.num_queued_tokens and self.num_queued_tokens + tokens > self.max_queued_tokens:
            self._on_reject("queue_full")
            raise queue_full(f"{self.num_queued_tokens} prompt tokens queued, limit {self.max_queued_tokens}",
                             RETRY_AFTER_S)
        self.num_queued += num
        self.num_queued_tokens += tokens
        self.num_in_flight += 1
        return Ticket(self, token_counts)

    async def wait_idle(self, timeout: float) -> bool:
        """Wait (bounded) until no admitted request is in flight; True if that happened."""
        deadline = time.monotonic() + timeout
        while self.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(min(_IDLE_POLL_S, max(0.0, deadline - time.monotonic())))
        return self.num_in_flight == 0


class Ticket:
    """One admitted API call. started(i) when engine request i produced its first token; release()
    when the call ends for any reason (idempotent)."""

    def __init__(self, admission: AdmissionControl, token_counts: list[int]) -> None:
        self._admission = admission
        self._queued = dict(enumerate(token_counts))
        self._released = False

    def started(self, index: int) -> None:
        tokens = self._queued.pop(index, None)
        if tokens is not None:
            self._admission.num_queued -= 1
            self._admission.num_queued_tokens -= tokens

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        for index in list(self._queued):
            self.started(index)
        self._admission.num_in_flight -= 1
