"""The typed messages between the API server and an engine core, and their msgpack codec.

API -> core: AddRequest | AbortRequests | StopRequests | SendKV | Shutdown. Core -> API: EngineReady (or
EngineStartupFailed) once, then one EngineStepOutputs per loop iteration (several coalesced into one when the API
server lags, see `coalesce`), and EngineDead before it exits for a lost executor. Tagged msgspec Structs around the
engine's own value types (EngineCoreRequest, EngineCoreTimes, EngineState ...), so a message names its type and
never a method to call, and decoding checks every field's type.

A request's output crosses as a RequestDelta: the token ids (and logprobs) it gained since its last delta, its
finish reason and times; never the output so far. Text is made on the API side (engine/output_processor.py)."""
from __future__ import annotations

import msgspec

from servelab.core.engine_io import EngineCoreOutput, EngineCoreRequest, EngineCoreTimes, EngineLimits
from servelab.metrics.events import EngineState, FinishedRequest, KVTransferSample, StepSample
from servelab.outputs import TokenLogprob


# ---- API server -> engine core
class AddRequest(msgspec.Struct, tag=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class StopRequests(msgspec.Struct, tag=True):
    """Engine-core requests (one per sample) whose stop string the API server's output processor matched: the
    core retires them as "stop". num_output_tokens: the tokens each kept (the core may have sampled more since;
    the metrics count these)."""
    request_ids: list[str]
    num_output_tokens: list[int]


class SendKV(msgspec.Struct, tag=True):
    """Disaggregated prefill/decode: send this finished prefill's held KV blocks to engine `dst` as
    transfer `tag` (the decode instance got the request with the same tag)."""
    request_id: str
    dst: int
    tag: int


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineInput = AddRequest | AbortRequests | StopRequests | SendKV | Shutdown


# ---- engine core -> API server
class RankProcess(msgspec.Struct):
    rank: int
    pid: int
    host: str


class EngineReady(msgspec.Struct, tag=True):
    """What the API server needs from a started core: the limits the input processor checks against
    (so the API process never loads weights) and what the metrics report."""
    engine_index: int
    pid: int
    limits: EngineLimits
    eos_token_ids: tuple[int, ...]
    weight_bytes_per_rank: tuple[int, ...]  # one entry per tensor-parallel rank
    kv_role: str = ""  # "kv_producer" (prefill) | "kv_consumer" (decode) under --disaggregate
    # The tensor-parallel worker processes (none when the model runs in the core's own process)
    ranks: list[RankProcess] = []
    # colocated: prefills and decodes; prefill / decode: one side of a --disaggregate split
    role: str = "colocated"
    # what --quantization resolved to (model/quant/auto_quantization.py): none | gguf | int8, the KV cache dtype, and why
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    quantization_reason: str = ""


class EngineStartupFailed(msgspec.Struct, tag=True):
    engine_index: int
    message: str


class RequestError(msgspec.Struct):
    request_id: str
    message: str
    # True: the engine refused the request itself (a ValueError, e.g. a duplicate id); False: the engine
    # failed while holding it (a failed add or step)
    invalid: bool = False


class RequestDelta(msgspec.Struct, array_like=True):
    """What one engine-core request (one sample) gained since its last delta."""
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprob] | None  # None unless the request asked for logprobs
    finish_reason: str | None  # None while running; "stop" | "length" | "abort"
    times: EngineCoreTimes

    @classmethod
    def of(cls, out: EngineCoreOutput) -> "RequestDelta":
        tokens = out.new_tokens  # several when speculative drafts were accepted
        if not tokens:
            return cls(out.request_id, [], None, out.finish_reason, out.times)
        logprobs = None if tokens[0].logprob is None else [
            TokenLogprob(t.token_id, t.logprob, t.top_logprobs or []) for t in tokens]  # type: ignore[arg-type]
        return cls(out.request_id, [t.token_id for t in tokens], logprobs, out.finish_reason, out.times)

    def add(self, newer: "RequestDelta") -> None:
        self.new_token_ids.extend(newer.new_token_ids)
        if newer.new_logprobs is not None:
            self.new_logprobs = (self.new_logprobs or []) + newer.new_logprobs
        self.finish_reason, self.times = newer.finish_reason, newer.times


class EngineStepOutputs(msgspec.Struct, tag=True):
    """One loop iteration of one core (or several, coalesced): the adds it took or refused, the deltas of its
    step (and of the aborts it applied), and the state after it."""
    engine_index: int
    state: EngineState
    # when these outputs left the engine (time.perf_counter, one clock for every process of the machine)
    output_time: float
    accepted: list[str] = []
    errors: list[RequestError] = []
    outputs: list[RequestDelta] = []
    steps: list[StepSample] = []
    finished: list[FinishedRequest] = []
    kv_transfers: list[KVTransferSample] = []  # KV blocks this core sent


def coalesce(pending: EngineStepOutputs, newer: EngineStepOutputs) -> None:
    """Fold `newer` into `pending`, which has not left yet because the API server is behind: a request's new
    deltas extend its pending one, so at most one delta per request waits however far behind the reader is.
    Everything else keeps its order (adds, errors, step samples and finished records are a few numbers each)."""
    pending.state, pending.output_time = newer.state, newer.output_time
    pending.accepted.extend(newer.accepted)
    pending.errors.extend(newer.errors)
    waiting = {d.request_id: d for d in pending.outputs if d.finish_reason is None}
    for delta in newer.outputs:
        older = waiting.get(delta.request_id)
        if older is None:
            pending.outputs.append(delta)
            older = delta
        else:
            older.add(delta)
        if older.finish_reason is None:
            waiting[delta.request_id] = older
        else:  # a later request may reuse the id: it gets its own delta
            waiting.pop(delta.request_id, None)
    pending.steps.extend(newer.steps)
    pending.finished.extend(newer.finished)
    pending.kv_transfers.extend(newer.kv_transfers)


class EngineDead(msgspec.Struct, tag=True):
    """The core's last message when its executor is gone (a tensor-parallel worker died): why, before it exits."""
    engine_index: int
    message: str


EngineOutput = EngineReady | EngineStartupFailed | EngineStepOutputs | EngineDead


class Codec:
    """msgpack encoder plus typed decoders for both directions (one per socket end)."""

    def __init__(self) -> None:
        self._encoder = msgspec.msgpack.Encoder()
        self._inputs = msgspec.msgpack.Decoder(EngineInput)
        self._outputs = msgspec.msgpack.Decoder(EngineOutput)

    def encode(self, message: EngineInput | EngineOutput) -> bytes:
        return self._encoder.encode(message)

    def decode_input(self, data: bytes) -> EngineInput:
        return self._inputs.decode(data)

    def decode_output(self, data: bytes) -> EngineOutput:
        return self._outputs.decode(data)
