"""What each engine core hands to the metrics recorder after each loop iteration: plain numbers,
built without touching Prometheus so the engine's hot path stays free of metric bookkeeping."""
from __future__ import annotations

from dataclasses import dataclass, field

from servelab.metrics.request_stats import RequestTiming


@dataclass(frozen=True)
class EngineState:
    num_running: int
    num_waiting: int
    kv_usage: float
    num_blocks: int
    num_free_blocks: int
    block_size: int
    num_reserved_unused_slots: int
    max_num_seqs: int
    num_preemptions_total: int
    # tokens looked up in the prefix cache at admission, and those found there (vLLM counts both in tokens)
    prefix_cache_queries_total: int = 0
    prefix_cache_hits_total: int = 0
    # speculative decoding (vLLM's spec_decode counters): requests that verified drafts, summed over steps;
    # draft tokens; accepted drafts; accepted drafts by position in the draft (one per speculative token,
    # empty when the engine does not speculate)
    spec_num_drafts_total: int = 0
    spec_num_draft_tokens_total: int = 0
    spec_num_accepted_tokens_total: int = 0
    spec_num_accepted_tokens_per_pos: tuple[int, ...] = ()


@dataclass(frozen=True)
class StepSample:
    duration: float
    num_scheduled_tokens: int
    num_generation_tokens: int
    # prompt tokens of requests (per sample when n > 1) whose first token came out this step
    num_prompt_tokens: int


@dataclass(frozen=True)
class FinishedRequest:
    request_id: str
    # one per completion (n of them); a completion with no tokens has no timing
    finish_reasons: list[str]
    timings: list[RequestTiming] = field(default_factory=list)


@dataclass(frozen=True)
class KVTransferSample:
    """One request's KV blocks moved between instances (disaggregated prefill/decode), as its sender saw it."""
    request_id: str
    num_bytes: int
    seconds: float
    ok: bool = True


@dataclass(frozen=True)
class EngineEvents:
    """One message of one engine core (a loop iteration, or several coalesced when the API server lagged): the
    state after it, the steps it ran, who finished."""
    state: EngineState
    steps: list[StepSample] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)
    engine_index: int = 0
    kv_transfers: list[KVTransferSample] = field(default_factory=list)
