"""EngineLoop: one iteration of an engine core's busy loop, the same code whether it runs in a thread of
the API server (--engine-in-process, tests) or in an engine-core process.

An iteration applies the inputs that came in (adds, aborts and stops, in order), runs one step when anything is
queued or running, and turns what happened into one EngineStepOutputs value: the adds taken or refused, one
RequestDelta per engine-core request that moved (its new token, no text), the state, the step's sample and the
requests that finished (with the time each token left the engine, for the latency metrics). A step that raises fails every request in the engine
(the batch is shared) and the loop keeps serving, unless the executor is gone (ExecutorDeadError: a
tensor-parallel worker died); that, and anything else that breaks, propagates to the runner."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from servelab.errors import ExecutorDeadError
from servelab.core.engine_io import EngineCoreOutput
from servelab.engine.core_proc.core_protocol import (AbortRequests, AddRequest, EngineReady, EngineStepOutputs, RankProcess,
                                           RequestDelta, RequestError, SendKV, StopRequests)
from servelab.metrics.events import FinishedRequest, KVTransferSample, StepSample
from servelab.metrics.request_stats import RequestTiming

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


@dataclass
class _Timing:
    """A request in this core, for the latency metrics: per sample, the time each of its output tokens left
    the engine, and how it finished."""
    num_prompt_tokens: int
    arrival: float
    token_times: list[list[float]]
    finish_reasons: list[str | None]
    first_scheduled: float | None = None

    def record(self, request_id: str, reason: str | None = None) -> FinishedRequest:
        timings = [RequestTiming(self.num_prompt_tokens, len(times), self.arrival, times[0], times[-1], times,
                                 self.first_scheduled) for times in self.token_times if times]
        return FinishedRequest(request_id, [reason or r or "abort" for r in self.finish_reasons], timings)


class EngineLoop:
    def __init__(self, engine: "LLMEngine", engine_index: int = 0) -> None:
        self.engine = engine
        self.engine_index = engine_index
        self._requests: dict[str, _Timing] = {}  # the requests this core holds
        self._sample_of: dict[str, tuple[str, int]] = {}  # engine-core request id -> (request id, sample index)
        self._last_stats = None

    def ready(self, pid: int) -> EngineReady:
        engine = self.engine
        ranks = [RankProcess(r.rank, r.pid, r.hostname) for r in engine.executor.worker_ranks]
        role = {"kv_producer": "prefill", "kv_consumer": "decode"}.get(engine.kv_role, "colocated")
        choice = engine.quantization_choice
        return EngineReady(self.engine_index, pid, engine.limits, engine.eos_token_ids,
                           tuple(engine.executor.weight_bytes_per_rank), engine.kv_role, ranks, role,
                           choice.mode, choice.kv_cache_dtype, choice.reason)

    def has_work(self) -> bool:
        return self.engine.has_unfinished_requests()

    def has_pending_kv(self) -> bool:
        """KV transfers on the wire (or received, waiting for blocks): poll again soon even when idle."""
        return self.engine.kv_handoff.has_pending()

    def run_once(self, inputs: list[AddRequest | AbortRequests | StopRequests | SendKV]) -> EngineStepOutputs | None:
        """Apply inputs and finished KV transfers, step if there is work; None when nothing happened."""
        kv = self.engine.poll_kv()
        if not inputs and not self.has_work() and not kv.transfers:
            return None
        out = EngineStepOutputs(self.engine_index, self.engine.get_state(), 0.0)
        for done in kv.transfers:
            if done.is_send:
                out.kv_transfers.append(KVTransferSample(done.request_id, done.num_bytes, done.seconds, done.ok))
        for request, message in kv.failed:
            request_id = request.request_id
            if self._forget(request_id) is not None:
                out.errors.append(RequestError(request_id, message))
                out.finished.append(FinishedRequest(request_id, ["error"]))
        for message in inputs:
            if isinstance(message, AddRequest):
                self._add(message, out)
            elif isinstance(message, SendKV):
                if not self.engine.kv_handoff.send(message.request_id, message.dst, message.tag):
                    logger.warning("no KV held for %s: not sent", message.request_id)
            elif isinstance(message, StopRequests):
                self._stop(message, out)
            else:
                for request_id in message.request_ids:
                    self._abort(request_id, out)
        if self.has_work():
            try:
                outputs = self.engine.step_core()
            except ExecutorDeadError:
                raise  # no later step can run: the core stops, and its requests end with engine_dead
            except Exception as exc:
                self._fail_step(exc, out)
            else:
                step = self._collect(outputs, out)
                if step is not None:
                    out.steps.append(step)
        out.output_time = time.perf_counter()
        out.state = self.engine.get_state()
        return out

    def _add(self, message: AddRequest, out: EngineStepOutputs) -> None:
        request = message.request
        try:
            samples = self.engine.add_core_request(request)
        except ValueError as exc:
            out.errors.append(RequestError(request.request_id, str(exc), invalid=True))
            return
        except Exception as exc:
            logger.exception("adding request %s failed", request.request_id)
            out.errors.append(RequestError(request.request_id, f"the engine could not take the request: {exc}"))
            return
        kv = request.kv_transfer
        token_times: list[list[float]] = [[] for _ in samples]
        if kv is not None and kv.do_remote_prefill and kv.first_token_time is not None:
            token_times = [[kv.first_token_time]]  # sampled on the prefill instance
        self._requests[request.request_id] = _Timing(len(request.prompt_token_ids), request.arrival_time,
                                                     token_times, [None] * len(samples))
        self._sample_of.update((s.request_id, (request.request_id, i)) for i, s in enumerate(samples))
        out.accepted.append(request.request_id)

    def _forget(self, request_id: str) -> _Timing | None:
        timing = self._requests.pop(request_id, None)
        if timing is None:
            return None
        if len(timing.token_times) == 1:
            self._sample_of.pop(request_id, None)
        else:
            for sample_id in [s for s, (owner, _) in self._sample_of.items() if owner == request_id]:
                del self._sample_of[sample_id]
        return timing

    def _abort(self, request_id: str, out: EngineStepOutputs) -> None:
        if request_id not in self._requests:  # finished already (a prefill may still hold its KV), or never taken
            self.engine.kv_handoff.release(request_id)
            return
        self._collect(self.engine.abort_core_request(request_id), out, "abort")
        timing = self._forget(request_id)  # left only if the engine had no sample of it to abort
        if timing is not None:
            out.finished.append(timing.record(request_id, "abort"))

    def _stop(self, message: StopRequests, out: EngineStepOutputs) -> None:
        """The API server matched these samples' stop strings: retire them, counting only the tokens kept."""
        for sample_id, num_tokens in zip(message.request_ids, message.num_output_tokens):
            entry = self._sample_of.get(sample_id)
            if entry is not None:
                del self._requests[entry[0]].token_times[entry[1]][num_tokens:]
        self._collect(self.engine.stop_core_requests(message.request_ids), out)

    def _fail_step(self, exc: Exception, out: EngineStepOutputs) -> None:
        """A step raised: fail the requests it ran, and keep the others if the engine is still consistent
        without them (check_invariants); else fail every request of this core. The step's requests may
        have half-written KV, so they are not retried."""
        # A step that failed before it had a plan (in the scheduler) cannot say whose it was: fail them all.
        failed = list(dict.fromkeys(self._sample_of[r][0] for r in self.engine.failed_step_request_ids()
                                    if r in self._sample_of)) or list(self._requests)
        logger.exception("engine step failed; failing its %d requests", len(failed))
        self._fail(failed, exc, out)
        try:
            self.engine.check_invariants()
        except Exception:
            logger.exception("the engine is inconsistent after a failed step; failing all %d requests",
                             len(self._requests))
            self._fail(list(self._requests), exc, out)

    def _fail(self, request_ids: list[str], exc: Exception, out: EngineStepOutputs) -> None:
        message = f"the engine step failed: {type(exc).__name__}: {exc}"
        for request_id in request_ids:
            self._forget(request_id)
            self.engine.abort_core_request(request_id)
            out.errors.append(RequestError(request_id, message))
            out.finished.append(FinishedRequest(request_id, ["error"]))
        if not self._requests and self.engine.has_unfinished_requests():
            raise RuntimeError("requests the loop does not know of are left in the engine") from exc

    def _collect(self, outputs: list[EngineCoreOutput], out: EngineStepOutputs,
                 reason: str | None = None) -> StepSample | None:
        """The outputs as deltas into `out`, their tokens' times and finished requests into the metrics."""
        now = time.perf_counter()
        num_generated = num_prompt = 0
        for output in outputs:
            entry = self._sample_of.get(output.request_id)
            if entry is None:
                continue
            request_id, index = entry
            timing = self._requests[request_id]
            if output.new_tokens:  # several when speculative drafts were accepted
                times = timing.token_times[index]
                if not times:
                    num_prompt += timing.num_prompt_tokens
                times.extend([now] * len(output.new_tokens))
                num_generated += len(output.new_tokens)
            if timing.first_scheduled is None:
                timing.first_scheduled = output.times.first_scheduled
            out.outputs.append(RequestDelta.of(output))
            if output.finish_reason is not None:
                del self._sample_of[output.request_id]
                timing.finish_reasons[index] = output.finish_reason
                if all(r is not None for r in timing.finish_reasons):
                    del self._requests[request_id]
                    out.finished.append(timing.record(request_id, reason))
        stats = self.engine.last_step_stats
        if stats is None or stats is self._last_stats:
            return None
        self._last_stats = stats
        return StepSample(stats.duration, stats.num_scheduled_tokens, num_generated, num_prompt)
