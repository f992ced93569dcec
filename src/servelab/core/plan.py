"""The one contract between the scheduler and any executor (real model or cost model)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from servelab.sampling_params import SamplingParams


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    token_ids are the tokens whose KV is computed this step: a prefill chunk, a recompute chunk
    after preemption, or the single last sampled token when decoding. They sit at positions
    num_computed_tokens .. num_computed_tokens + len(token_ids) - 1. block_ids is the request's
    whole block table (it covers every position up to the end of this step). When sample is set,
    the logits of the last token are sampled to give the request's next output token.
    prompt_token_ids / output_token_ids are set only when the executor has not seen the request
    before (first schedule, or rescheduled after preemption) so it can build its penalty state.
    num_spec_tokens (speculative decoding): the last num_spec_tokens of token_ids are draft tokens (the
    first is the request's last sampled token); the executor samples after each of the 1 + num_spec_tokens
    positions and keeps the drafts its samples agree with (StepResult.spec_sampled).
    """

    request_id: str
    token_ids: list[int]
    num_computed_tokens: int
    block_ids: list[int]
    sample: bool
    sampling_params: SamplingParams
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    num_spec_tokens: int = 0

    @property
    def num_new_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        return self.num_computed_tokens + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    # Requests whose executor-side state can be dropped (finished, aborted, or preempted: a
    # preempted request comes back with prompt_token_ids set).
    finished_request_ids: list[str] = field(default_factory=list)
    preempted_request_ids: list[str] = field(default_factory=list)
    # Structured output (structured_output/manager.py): one row of allowed next tokens per constrained request
    # that samples this step, an int32 numpy array (rows, ceil(vocab / 32)) whose bit t of a row allows
    # token t; grammar_request_ids names each row's request. While it is being filled (beside the forward
    # pass) it is a concurrent.futures.Future of that array: read it with grammar_bitmask_now().
    grammar_bitmask: Any = None
    grammar_request_ids: list[str] | tuple[()] = ()  # a tuple by default: no list per plan in the lab's hot loop

    def grammar_bitmask_now(self) -> Any:
        """The bitmask array, waiting for it to be filled; None when no request is constrained."""
        if hasattr(self.grammar_bitmask, "result"):
            self.grammar_bitmask = self.grammar_bitmask.result()
        return self.grammar_bitmask

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    # (token_id, logprob) of the most likely tokens, when logprobs were asked for.
    top_logprobs: list[tuple[int, float]] | None = None


@dataclass(slots=True)
class StepResult:
    sampled: dict[str, SampledToken] = field(default_factory=dict)
    # Seconds the step took: measured by a real executor, predicted by the cost model.
    duration: float = 0.0
    # Cost-model components (weights, attention, communication, overhead), seconds.
    breakdown: dict[str, float] = field(default_factory=dict)
    # Requests that verified drafts (num_spec_tokens > 0), instead of an entry in sampled: the drafts the
    # samples agreed with, then the sample after the last of them (1 to 1 + num_spec_tokens tokens).
    spec_sampled: dict[str, list[SampledToken]] = field(default_factory=dict)


@dataclass(slots=True)
class DecodeRunPlan:
    """Up to num_steps decode steps of a fixed batch, all known in advance (core/decode_runs/planner.py): in
    each, every member not yet at max_tokens computes its last sampled token and samples the next; no
    one is admitted (beyond step 1) or preempted, and no sampled token stops anyone. All a cost model
    needs to price the steps, as a StepPlan is for one step."""

    batch_size: int  # members in step 1
    context_len_sum: int  # sum of step 1's context lengths (num_computed_tokens + 1 each)
    num_steps: int
    soonest: int  # fewest steps any member takes part in before it finishes on length
    # (steps it takes part in, context length in step 1) of each member leaving before step num_steps,
    # by steps taken (empty when soonest >= num_steps): the batch shrinks after each.
    departures: list[tuple[int, int]] = field(default_factory=list)
    # A one-step run whose step admits the waiting head (and maybe more), as schedule() would.
    admits: bool = False
