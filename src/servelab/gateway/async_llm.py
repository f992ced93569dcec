"""AsyncLLM: an LLMEngine stepped by one background thread, bridged to asyncio.

Requests are tokenized and validated on the event loop by the input processor; what crosses to the
engine thread is the resulting EngineCoreRequest. The engine thread is the only writer of engine state.
Adds and aborts from the event loop go into an inbox that the thread drains between steps; when nothing
is queued or running it sleeps on a condition (no busy spin). Outputs go back through one
`loop.call_soon_threadsafe` per step to each request's RequestStream. Metrics leave as plain-number
EngineEvents through `on_events`.

Cancellation contract: `abort(request_id)` takes effect before the engine's next step, and the
request's KV blocks are back in the pool when it returns to the thread's loop. A step that raises
aborts every request in the engine and fails each with EngineStepError; the server keeps serving.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from servelab.core.messages import EngineCoreRequest
from servelab.engine.input_processor import PromptType
from servelab.engine.llm_engine import LLMEngine
from servelab.gateway.request_stream import RequestStream
from servelab.metrics.events import EngineEvents, FinishedRequest, StepSample
from servelab.metrics.request_stats import RequestTiming
from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An engine step raised; the requests in the engine were aborted."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served."""


@dataclass
class _AddRequest:
    request: EngineCoreRequest
    stream: RequestStream


@dataclass
class _AbortRequest:
    request_id: str
    # delivered to the stream instead of the "abort" snapshot (shutdown, a gateway-side failure)
    error: BaseException | None = None


@dataclass
class _AbortAll:
    error: BaseException


@dataclass
class _Tracked:
    stream: RequestStream
    # per completion: the time each output token left the engine (end of its step)
    token_times: list[list[float]] = field(default_factory=list)


class AsyncLLM:
    def __init__(self, engine: LLMEngine, on_events: Callable[[EngineEvents], None] | None = None) -> None:
        self.engine = engine
        self.input_processor = engine.input_processor
        self._on_events = on_events
        self._cond = threading.Condition()
        self._inbox: list[_AddRequest | _AbortRequest | _AbortAll] = []
        self._stopping = False
        self._closed = False  # the thread has exited: nothing posted will be handled
        self._tracked: dict[str, _Tracked] = {}  # engine thread only
        self._last_stats = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self.dead_error: BaseException | None = None

    # ---- lifecycle (event loop)
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="servelab-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout: float = 10.0) -> None:
        """Fail whatever is left, stop the thread and wait for it (blocking, bounded)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.dead_error is None

    # ---- requests (event loop)
    def submit(self, request: EngineCoreRequest) -> RequestStream:
        """Hand a processed request to the engine thread. Await `stream.accepted` before iterating: it
        raises EngineDeadError when the engine is gone, ValueError when the engine refuses the request (a
        duplicate id)."""
        stream = RequestStream(request.request_id, self._loop)
        if self._thread is None or not self._post(_AddRequest(request, stream)):
            stream.on_error(EngineDeadError(str(self.dead_error or "the engine thread is not running")))
        return stream

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
        stream = await self.add_request(request_id, prompt, params, arrival_time)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.done:
                self.abort(request_id)

    def abort(self, request_id: str, error: BaseException | None = None) -> None:
        """Thread-safe. With `error`, the request's stream raises it instead of ending with "abort"."""
        self._post(_AbortRequest(request_id, error))

    def abort_all(self, error: BaseException) -> None:
        self._post(_AbortAll(error))

    def _post(self, message) -> bool:
        with self._cond:
            if self._closed:
                return False
            self._inbox.append(message)
            self._cond.notify()
            return True

    # ---- the engine thread
    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                with self._cond:
                    while not self._inbox and not self._stopping and not engine.has_unfinished_requests():
                        self._cond.wait()
                    inbox, self._inbox = self._inbox, []
                    stopping = self._stopping
                calls: list[tuple] = []
                finished: list[FinishedRequest] = []
                for message in inbox:
                    self._handle(message, calls, finished)
                if stopping:
                    error = EngineDeadError("the server is shutting down")
                    self._abort_everything(error, calls, finished)
                    self._close_inbox(error, calls)
                    self._flush(calls, None, finished)
                    return
                step = None
                if engine.has_unfinished_requests():
                    try:
                        outputs = engine.step()
                    except Exception as exc:
                        logger.exception("engine step failed; aborting %d requests", len(self._tracked))
                        self._recover(exc, calls, finished)
                    else:
                        step = self._collect(outputs, calls, finished)
                self._flush(calls, step, finished)
        except BaseException as exc:  # the loop itself broke: fail everyone, refuse new work
            logger.exception("engine thread died")
            self.dead_error = exc
            error = EngineDeadError(f"the engine thread died: {exc}")
            calls = [(t.stream.on_error, error) for t in self._tracked.values()]
            self._tracked.clear()
            self._close_inbox(error, calls)
            self._call_soon(calls)

    def _close_inbox(self, error: BaseException, calls: list) -> None:
        """Refuse further posts and fail the adds that came in too late."""
        with self._cond:
            self._closed = True
            late, self._inbox = self._inbox, []
        calls.extend((m.stream.on_error, error) for m in late if isinstance(m, _AddRequest))

    def _handle(self, message, calls: list, finished: list[FinishedRequest]) -> None:
        engine = self.engine
        if isinstance(message, _AddRequest):
            stream, request = message.stream, message.request
            try:
                engine.add_request(request)
            except ValueError as exc:
                calls.append((stream.on_error, exc))
                return
            except Exception as exc:
                logger.exception("adding request %s failed", request.request_id)
                calls.append((stream.on_error, EngineStepError(f"the engine could not take the request: {exc}")))
                return
            self._tracked[request.request_id] = _Tracked(stream, [[] for _ in range(request.sampling_params.n)])
            calls.append((stream.on_accepted,))
        elif isinstance(message, _AbortRequest):
            self._abort(message.request_id, message.error, calls, finished)
        elif isinstance(message, _AbortAll):
            self._abort_everything(message.error, calls, finished)

    def _abort(self, request_id: str, error: BaseException | None, calls: list,
               finished: list[FinishedRequest]) -> None:
        tracked = self._tracked.pop(request_id, None)
        if tracked is None:  # finished already, or never accepted
            return
        outputs = self.engine.abort_request(request_id)
        if error is not None:
            calls.append((tracked.stream.on_error, error))
        else:
            calls.extend((tracked.stream.on_output, out, None) for out in outputs)
        finished.append(self._finished_record(request_id, tracked, outputs[-1] if outputs else None, "abort"))

    def _abort_everything(self, error: BaseException, calls: list, finished: list[FinishedRequest]) -> None:
        for request_id in list(self._tracked):
            self._abort(request_id, error, calls, finished)

    def _recover(self, exc: Exception, calls: list, finished: list[FinishedRequest]) -> None:
        """A step raised: every request in the engine is affected (the batch is shared)."""
        error = EngineStepError(f"the engine step failed: {type(exc).__name__}: {exc}")
        for request_id, tracked in list(self._tracked.items()):
            self._tracked.pop(request_id)
            self.engine.abort_request(request_id)
            calls.append((tracked.stream.on_error, error))
            finished.append(self._finished_record(request_id, tracked, None, "error"))
        if self.engine.has_unfinished_requests():
            raise RuntimeError("requests the gateway does not know of are left in the engine") from exc
        self.engine.check_invariants()

    def _collect(self, outputs: list[RequestOutput], calls: list, finished: list[FinishedRequest]) -> StepSample | None:
        now = time.perf_counter()
        num_generated = num_prompt = 0
        for out in outputs:
            tracked = self._tracked.get(out.request_id)
            if tracked is None:
                continue
            got_token = False
            for completion in out.outputs:
                times = tracked.token_times[completion.index]
                num_new = len(completion.token_ids) - len(times)
                if num_new > 0:
                    if not times:
                        num_prompt += len(out.prompt_token_ids)
                    times.extend([now] * num_new)
                    num_generated += num_new
                    got_token = True
            calls.append((tracked.stream.on_output, out, now if got_token else None))
            if out.finished:
                del self._tracked[out.request_id]
                finished.append(self._finished_record(out.request_id, tracked, out, None))
        stats = self.engine.last_step_stats
        if stats is None or stats is self._last_stats:
            return None
        self._last_stats = stats
        return StepSample(stats.duration, stats.num_scheduled_tokens, num_generated, num_prompt)

    @staticmethod
    def _finished_record(request_id: str, tracked: _Tracked, out: RequestOutput | None,
                         reason: str | None) -> FinishedRequest:
        n = len(tracked.token_times)
        if out is None:
            return FinishedRequest(request_id, [reason or "abort"] * n)
        timings = []
        for completion in out.outputs:
            times = tracked.token_times[completion.index]
            if times:
                timings.append(RequestTiming(len(out.prompt_token_ids), len(completion.token_ids),
                                             out.metrics.arrival_time, times[0], times[-1], times,
                                             out.metrics.first_scheduled_time))
        reasons = [reason or completion.finish_reason or "abort" for completion in out.outputs]
        return FinishedRequest(request_id, reasons, timings)

    def _flush(self, calls: list, step: StepSample | None, finished: list[FinishedRequest]) -> None:
        self._call_soon(calls)
        if self._on_events is not None:
            self._on_events(EngineEvents(self.engine.get_state(), step, finished))

    def _call_soon(self, calls: list) -> None:
        if not calls or self._loop is None:
            return
        try:
            self._loop.call_soon_threadsafe(_run_calls, calls)
        except RuntimeError:  # the loop is closed: nobody is listening any more
            pass


def _run_calls(calls: list) -> None:
    for fn, *args in calls:
        fn(*args)
