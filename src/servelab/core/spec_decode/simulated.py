"""The lab's proposer: its requests' token ids are placeholders, so there is nothing to look up. It drafts
num_speculative_tokens placeholders at every decode step, and the cost model's executor accepts each draft
with the acceptance rate (executor/cost_model_executor.py): the steps are scheduled, sized and priced as
the real engine's are. It does not adapt the draft length (SpeculativeConfig.draft_min_acceptance): placeholders
tell it nothing, so the lab prices K verify rows at every decode step (docs/lab.md says what that misses)."""
from __future__ import annotations

from servelab.core.request import Request


class SimulatedProposer:
    def __init__(self, num_speculative_tokens: int, token_id: int = 0) -> None:
        self.num_speculative_tokens = num_speculative_tokens
        self.token_id = token_id

    def propose(self, request: Request, max_num_tokens: int) -> list[int]:
        return [self.token_id] * min(self.num_speculative_tokens, max_num_tokens)

    def drop(self, request_id: str) -> None:
        """Nothing kept per request."""
