"""The values that cross the engine core's boundary: what goes in (EngineCoreRequest), what comes out
(EngineCoreOutput) and the limits the core announces (EngineLimits). Plain data, never a live Request,
so the core can later move to its own process behind typed messages."""
from __future__ import annotations

from dataclasses import dataclass

from servelab.core.plan import SampledToken
from servelab.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """What the API server may know of an engine core: fixed at start-up, enough to validate a request."""
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int


@dataclass(frozen=True)
class KVTransferParams:
    """A request's part in disaggregated prefill/decode (vLLM's kv_transfer_params).

    do_remote_decode (on a prefill instance): after its first token, the request's KV blocks stay held
    until they have been sent to a decode instance (or released). do_remote_prefill (on a decode
    instance): its prompt's KV arrives from engine remote_engine as transfer `tag`, and its first token
    (with the times it was scheduled and sampled there) is first_token."""
    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine: int = 0
    tag: int = 0
    first_token: SampledToken | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None


@dataclass(frozen=True)
class EngineCoreRequest:
    """A tokenized, validated request (the input processor's output); one per engine-core request, so a
    request with n samples becomes n of them."""
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # params.max_tokens clamped to the room the context leaves after the prompt
    max_tokens: int
    eos_token_ids: tuple[int, ...]
    arrival_time: float
    kv_transfer: KVTransferParams | None = None


# EngineCoreTimes and EngineCoreOutput are slotted, not frozen: one is built for every token a real engine
# samples and every request the lab finishes, and a frozen dataclass sets each field through
# object.__setattr__ (vLLM's EngineCoreOutput is a mutable msgspec Struct too). Nobody changes them.
@dataclass(slots=True)
class EngineCoreTimes:
    """A request's timestamps as of one output (engine clock seconds; None until it happened)."""
    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    last_token: float | None = None
    finished: float | None = None
    num_preemptions: int = 0


@dataclass(slots=True)
class EngineCoreOutput:
    request_id: str
    new_tokens: list[SampledToken]  # this step's: usually one; several when speculative drafts were accepted
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    times: EngineCoreTimes

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
