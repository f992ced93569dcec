"""AsyncLLM: the API server's side of one or more engine cores (data-parallel replicas).

Requests are tokenized and validated on the event loop by the input processor (with the limits each core
announced when it started); what goes to a core is the resulting EngineCoreRequest, sent to the least
loaded core through its client (core_client.py: its own process, or a thread with --engine-in-process).
One asyncio task per core awaits its EngineStepOutputs, whose RequestDeltas (new token ids, no text) the
output processor turns into RequestOutput deltas here, in the API process (detokenizing, cutting stop
strings: a sample a stop string ended is retired in its core with StopRequests), and hands each to its
request's RequestStream; metrics leave as plain-number EngineEvents through `on_events`.

Cancellation contract: `abort(request_id)` takes effect before the core's next step, and the request's
KV blocks are back in the pool when its final ("abort") output is delivered. A step that raises fails
the requests that step ran with EngineStepError (every request of that core when its KV bookkeeping no
longer checks out); the core keeps serving. A core that dies (crash,
kill -9, OOM) fails every request in flight with EngineDeadError and refuses new ones; `dead` is set so
the server can exit and be restarted.

Disaggregated prefill/decode (cores announcing kv_producer / kv_consumer roles): a request goes to the
least loaded prefill core with max_tokens 1, and its blocks are held there after its first token, which
streams at once. Then the least loaded decode core gets the request with that token and a transfer tag,
and the prefill core is told to send the blocks to it under the same tag (KVHandoff). An abort reaches
both; blocks on the wire are freed on both sides when the transfer ends.
"""
from __future__ import annotations

import asyncio
import logging
import itertools
from collections import defaultdict
from dataclasses import dataclass
from typing import AsyncIterator, Callable, Sequence

from servelab.core.block_hash import hash_token_blocks
from servelab.core.engine_io import EngineCoreRequest, EngineLimits
from servelab.core.prefix_router import PrefixRouter
from servelab.engine.core_client import EngineCoreClient, EngineDeadError, EngineStepError
from servelab.engine.core_proc.core_protocol import EngineStepOutputs, RequestDelta
from servelab.engine.input_processor import InputProcessor, PromptType, child_requests
from servelab.engine.engine_loads import EngineLoads
from servelab.engine.kv_handoff import decode_request, prefill_request
from servelab.engine.output_processor import OutputProcessor
from servelab.engine.request_stream import RequestStream
from servelab.metrics.events import EngineEvents
from servelab.model.tokenizer import Tokenizer
from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams

__all__ = ["AsyncLLM", "EngineDeadError", "EngineStepError"]

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    stream: RequestStream
    engine_index: int
    num_requests: int  # engine-core requests (n samples)
    accepted: bool = False
    # delivered instead of the final "abort" output (shutdown, a gateway-side failure)
    abort_error: BaseException | None = None
    # disaggregated: the request for the decode core, until its prefill is handed off
    decode_request: EngineCoreRequest | None = None
    prefill_index: int | None = None  # the prefill core, once handed off (it may still be sending)
    aborting: bool = False


class AsyncLLM:
    def __init__(self, cores: Sequence[EngineCoreClient], tokenizer: Tokenizer,
                 on_events: Callable[[EngineEvents], None] | None = None, router: str = "least-loaded") -> None:
        self.cores = list(cores)
        infos = [core.info for core in self.cores]
        # every core must be able to run any request, so validate against the smallest
        self.limits = EngineLimits(*(min(getattr(i.limits, f) for i in infos)
                                     for f in ("max_model_len", "vocab_size", "num_blocks", "block_size")))
        self.input_processor = InputProcessor(tokenizer, self.limits, infos[0].eos_token_ids)
        self.output_processor = OutputProcessor(tokenizer)
        self.weight_bytes = sum(infos[0].weight_bytes_per_rank)
        self._on_events = on_events
        self._loads = EngineLoads(len(self.cores))
        # --router prefix: data-parallel cores (or prefill cores) chosen by cached prompt blocks against load
        self._prefix_router = PrefixRouter(self.limits.num_blocks) if router == "prefix" else None
        roles = [getattr(i, "kv_role", "") for i in infos]
        self.prefill_indices = [i for i, role in enumerate(roles) if role == "kv_producer"]
        self.decode_indices = [i for i, role in enumerate(roles) if role == "kv_consumer"]
        self.disaggregated = bool(self.prefill_indices)
        if self.disaggregated != bool(self.decode_indices):
            raise ValueError("a disaggregated deployment needs both prefill and decode engine cores")
        self._kv_tags = itertools.count(1)
        self._tracked: dict[str, _Tracked] = {}
        self._tasks: list[asyncio.Task] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self.dead_error: EngineDeadError | None = None
        self.dead = asyncio.Event()  # set once a core died
        self.num_failed_steps = 0  # steps that raised (their requests failed; the core kept serving)
        self.last_step_error: str | None = None

    @classmethod
    def in_process(cls, engine, on_events: Callable[[EngineEvents], None] | None = None) -> "AsyncLLM":
        """One LLMEngine stepped by a thread of this process (tests, --engine-in-process)."""
        from servelab.engine.core_client import InprocClient

        return cls([InprocClient(engine)], engine.tokenizer, on_events)

    @property
    def max_model_len(self) -> int:
        return self.limits.max_model_len

    @property
    def num_engines(self) -> int:
        return len(self.cores)

    # ---- lifecycle (event loop)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        for index, core in enumerate(self.cores):
            core.start()
            self._tasks.append(asyncio.create_task(self._receive(index, core), name=f"servelab-engine-{index}"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Fail whatever is left, stop the output tasks, then stop every core (bounded; killed if needed)."""
        if self._closed:
            return
        self._closed = True
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_all(EngineDeadError("the server is shutting down"))
        await asyncio.gather(*(core.shutdown(timeout) for core in self.cores))

    @property
    def is_running(self) -> bool:
        return self._loop is not None and not self._closed and self.dead_error is None

    @property
    def not_running_reason(self) -> str:
        if self.dead_error is not None:
            return str(self.dead_error)
        return "the server is shutting down" if self._closed else "the engine is not started"

    # ---- requests (event loop)
    def submit(self, request: EngineCoreRequest) -> RequestStream:
        """Hand a processed request to the least loaded core. Await `stream.accepted` before iterating: it
        raises EngineDeadError when the engine is gone, ValueError when the request is refused (a
        duplicate id)."""
        stream = RequestStream(request.request_id, self._loop or asyncio.get_running_loop())
        if not self.is_running:
            stream.on_error(EngineDeadError(self.not_running_reason))
            return stream
        if request.request_id in self._tracked:
            stream.on_error(ValueError(f"duplicate request id {request.request_id!r}"))
            return stream
        later = None
        if self.disaggregated:
            if request.sampling_params.n != 1:
                stream.on_error(ValueError("n > 1 is not supported with --disaggregate"))
                return stream
            index = self._route(request, self.prefill_indices)
            request, later = prefill_request(request)
        else:
            index = self._route(request, list(range(len(self.cores))))
        num_requests = request.sampling_params.n
        try:
            self.cores[index].add_request(request)
        except EngineDeadError as exc:
            stream.on_error(exc)
            return stream
        self.output_processor.add_request(later or request, child_requests(later or request))
        self._tracked[request.request_id] = _Tracked(stream, index, num_requests, decode_request=later)
        self._loads.sent(index, num_requests)
        return stream

    def _route(self, request: EngineCoreRequest, among: list[int]) -> int:
        if self._prefix_router is None:
            return self._loads.pick(among)
        hashes = hash_token_blocks(request.prompt_token_ids, self.limits.block_size)
        index = among[self._prefix_router.pick(among, [self._loads.load(i) for i in among], hashes)]
        self._prefix_router.routed(index, hashes)
        return index

    async def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams,
                          arrival_time: float | None = None) -> RequestStream:
        """Process the prompt (ValueError for a bad one), submit() it and wait until the engine took it."""
        stream = self.submit(self.input_processor.process_inputs(request_id, prompt, params, arrival_time))
        try:
            await stream.accepted
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return stream

    async def generate(self, request_id: str, prompt: PromptType, params: SamplingParams,
                       arrival_time: float | None = None) -> AsyncIterator[RequestOutput]:
        """The request's output so far, each time it changed (a copy each time: the gateway reads a stream's
        deltas instead)."""
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        so_far: RequestOutput | None = None
        try:
            async for delta in stream:
                if so_far is None:
                    so_far = delta.copy()
                else:
                    so_far.add(delta)
                yield so_far.copy()
        finally:
            if not stream.done:
                self.abort(request_id)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """With `error`, the request's stream raises it instead of ending with "abort"."""
        self.abort_many([request_id], error)

    def abort_all(self, error: BaseException) -> None:
        self.abort_many(list(self._tracked), error)

    def abort_many(self, request_ids: list[str], error: BaseException | None = None) -> None:
        by_engine: dict[int, list[str]] = defaultdict(list)
        for request_id in request_ids:
            tracked = self._tracked.get(request_id)
            if tracked is None:  # finished, failed, or never submitted
                continue
            if error is not None:
                tracked.abort_error = error
            tracked.aborting = True
            by_engine[tracked.engine_index].append(request_id)
            if tracked.prefill_index is not None:  # it may still be sending (it then frees after the send)
                by_engine[tracked.prefill_index].append(request_id)
        for index, ids in by_engine.items():
            self.cores[index].abort_requests(ids)

    # ---- outputs (one task per core)
    async def _receive(self, index: int, core: EngineCoreClient) -> None:
        try:
            while True:
                self._dispatch(await core.get_output())
        except EngineDeadError as exc:
            self._on_dead(index, exc)
        except Exception as exc:  # a bug on this side: as fatal as a dead core, and said so
            logger.exception("receiving from engine core %d failed", index)
            self._on_dead(index, EngineDeadError(f"receiving from engine core {index} failed: {exc}"))

    def _dispatch(self, out: EngineStepOutputs) -> None:
        index, tracked = out.engine_index, self._tracked
        for request_id in out.accepted:
            t = tracked.get(request_id)
            if t is not None:
                t.accepted = True
                self._loads.answered(index, t.num_requests)
                t.stream.on_accepted()
        step_errors = [e.message for e in out.errors if not e.invalid]
        if step_errors:
            self.num_failed_steps += 1
            self.last_step_error = f"engine core {index}: {step_errors[0]}"
        for error in out.errors:
            t = tracked.pop(error.request_id, None)
            if t is None:
                continue
            if not t.accepted:
                self._loads.answered(index, t.num_requests)
            t.stream.on_error(ValueError(error.message) if error.invalid else EngineStepError(error.message))
        for error in out.errors:
            self.output_processor.forget(error.request_id)
        handing_off = self._prefills_done(out)
        processed = self.output_processor.process(out.outputs)
        if processed.stopped_request_ids:
            self.cores[index].stop_requests(processed.stopped_request_ids, processed.stopped_num_tokens)
        handed_off = set()
        for output in processed.request_outputs:
            t = tracked.get(output.request_id)
            if t is None:
                continue
            if output.request_id in handing_off and not output.finished:
                if not self._hand_off(t, handing_off[output.request_id]):
                    continue  # no decode core could take it: failed
                handed_off.add(output.request_id)
            if output.finished:
                del tracked[output.request_id]
                if t.abort_error is not None and any(c.finish_reason == "abort" for c in output.outputs):
                    t.stream.on_error(t.abort_error)
                    continue
            has_tokens = any(c.token_ids for c in output.outputs)
            t.stream.on_output(output, out.output_time if has_tokens else None)
        self._loads.report(index, out.state)
        if self._on_events is not None:
            finished = [f for f in out.finished if f.request_id not in handed_off] if handed_off else out.finished
            self._on_events(EngineEvents(out.state, out.steps, finished, engine_index=index,
                                         kv_transfers=out.kv_transfers))

    def _prefills_done(self, out: EngineStepOutputs) -> dict[str, RequestDelta]:
        """Disaggregated: the prefills that finished with their first token ("length" at max_tokens 1), which a
        decode core continues. Their finish is taken off the delta, so the output processor keeps the request
        open (unless that token completes a stop string: the prefill core then frees the blocks on the
        StopRequests it gets). An aborted one ends there."""
        done = {}
        for delta in out.outputs:
            if delta.finish_reason == "length":
                t = self._tracked.get(delta.request_id)
                if t is not None and t.decode_request is not None and not t.aborting:
                    done[delta.request_id] = delta
                    delta.finish_reason = None
        return done

    def _hand_off(self, t: _Tracked, prefilled: RequestDelta) -> bool:
        """A prefill finished with its first token: send the request to the least loaded decode core and
        tell the prefill core to send it the KV. False when no decode core could take it (the request failed)."""
        prefill, tag = t.engine_index, next(self._kv_tags)
        request, t.decode_request = decode_request(t.decode_request, prefilled, prefill, tag), None
        decode = self._loads.pick(self.decode_indices)
        try:
            self.cores[decode].add_request(request)
        except EngineDeadError as exc:
            self.cores[prefill].abort_requests([request.request_id])
            self.output_processor.forget(request.request_id)
            del self._tracked[request.request_id]
            t.stream.on_error(exc)
            return False
        self.cores[prefill].send_kv(request.request_id, decode, tag)
        t.engine_index, t.prefill_index = decode, prefill
        t.accepted = False  # until the decode core takes it (its load counts it as in transit meanwhile)
        self._loads.sent(decode, 1)
        return True

    def _on_dead(self, index: int, error: EngineDeadError) -> None:
        if self._closed:  # stopping on purpose
            return
        logger.error("%s; failing %d requests in flight", error, len(self._tracked))
        if self.dead_error is None:
            self.dead_error = error
        survivors = [i for i, task in enumerate(self._tasks) if i != index and not task.done()]
        self.abort_many([r for r, t in self._tracked.items()
                         if t.engine_index in survivors or t.prefill_index in survivors])
        self._fail_all(EngineDeadError(str(error)))
        self.dead.set()

    def _fail_all(self, error: BaseException) -> None:
        tracked, self._tracked = self._tracked, {}
        for request_id, t in tracked.items():
            self.output_processor.forget(request_id)
            t.stream.on_error(error)
