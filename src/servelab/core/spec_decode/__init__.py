"""Speculative decoding's proposers: who guesses a request's next tokens for the step to verify.

The scheduler asks its proposer for drafts when it schedules a decoding request, gives the request
1 + len(drafts) token slots, and after the step keeps the drafts the executor verified
(core/scheduler.py). NgramProposer (prompt lookup) runs in the real engine; the lab's
SimulatedProposer drafts placeholders, and the cost model's executor accepts them at a given rate."""
from __future__ import annotations

from typing import Protocol

from servelab.core.request import Request


class Proposer(Protocol):
    num_speculative_tokens: int  # the most drafts it proposes at once

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        """Up to max_num_tokens guesses of the tokens after the request's last one (maybe none)."""

    def drop(self, request_id: str) -> None:
        """Forget a finished request."""
