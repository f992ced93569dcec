"""The typed messages between the API server and an engine core, and their msgpack codec.

API -> core: AddRequest | AbortRequests | SendKV | Shutdown. Core -> API: EngineReady (or EngineStartupFailed) once,
then one EngineStepOutputs per loop iteration, and EngineDead before it exits for a lost executor. Tagged msgspec Structs around the engine's own value types
(EngineCoreRequest, RequestOutput, EngineState ...), so a message names its type and never a method to
call, and decoding checks every field's type."""
from __future__ import annotations

import msgspec

from servelab.core.engine_io import EngineCoreRequest, EngineLimits
from servelab.metrics.events import EngineState, FinishedRequest, KVTransferSample, StepSample
from servelab.outputs import RequestOutput


# ---- API server -> engine core
class AddRequest(msgspec.Struct, tag=True):
    request: EngineCoreRequest


class AbortRequests(msgspec.Struct, tag=True):
    request_ids: list[str]


class SendKV(msgspec.Struct, tag=True):
    """Disaggregated prefill/decode: send this finished prefill's held KV blocks to engine `dst` as
    transfer `tag` (the decode instance got the request with the same tag)."""
    request_id: str
    dst: int
    tag: int


class Shutdown(msgspec.Struct, tag=True):
    pass


EngineInput = AddRequest | AbortRequests | SendKV | Shutdown


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
    # what --quantization resolved to (model/auto_quantization.py): none | gguf | int8, the KV cache dtype, and why
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


class EngineStepOutputs(msgspec.Struct, tag=True):
    """One loop iteration of one core: the adds it took or refused, the outputs of its step (and of the
    aborts it applied), and the state after it."""
    engine_index: int
    state: EngineState
    # when these outputs left the engine (time.perf_counter, one clock for every process of the machine)
    output_time: float
    accepted: list[str] = []
    errors: list[RequestError] = []
    outputs: list[RequestOutput] = []
    step: StepSample | None = None
    finished: list[FinishedRequest] = []
    kv_transfers: list[KVTransferSample] = []  # KV blocks this core sent


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
