"""EngineLoop: one iteration of an engine core's busy loop, the same code whether it runs in a thread of
the API server (--engine-in-process, tests) or in an engine-core process.

An iteration applies the inputs that came in (adds and aborts, in order), runs one step when anything is
queued or running, and turns what happened into one EngineStepOutputs value: the adds taken or refused,
the request outputs, the state, the step's sample and the requests that finished (with the time each
token left the engine, for the latency metrics). A step that raises fails every request in the engine
(the batch is shared) and the loop keeps serving, unless the executor is gone (ExecutorDeadError: a
tensor-parallel worker died); that, and anything else that breaks, propagates to the runner."""
from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from servelab.errors import ExecutorDeadError
from servelab.engine.core_protocol import (AbortRequests, AddRequest, EngineReady, EngineStepOutputs, RankProcess,
                                           RequestError, SendKV)
from servelab.metrics.events import FinishedRequest, KVTransferSample, StepSample
from servelab.metrics.request_stats import RequestTiming
from servelab.outputs import RequestOutput

if TYPE_CHECKING:
    from servelab.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: "LLMEngine", engine_index: int = 0) -> None:
        self.engine = engine
        self.engine_index = engine_index
        # request id -> per completion, the time each of its output tokens left the engine
        self._token_times: dict[str, list[list[float]]] = {}
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
        return self.engine.has_pending_kv()

    def run_once(self, inputs: list[AddRequest | AbortRequests | SendKV]) -> EngineStepOutputs | None:
        """Apply inputs and finished KV transfers, step if there is work; None when nothing happened."""
        kv = self.engine.poll_kv()
        if not inputs and not self.has_work() and not kv.transfers:
            return None
        out = EngineStepOutputs(self.engine_index, self.engine.get_state(), 0.0)
        for done in kv.transfers:
            if done.is_send:
                out.kv_transfers.append(KVTransferSample(done.request_id, done.num_bytes, done.seconds, done.ok))
        for request_id, message in kv.failed:
            token_times = self._token_times.pop(request_id, None)
            if token_times is not None:
                out.errors.append(RequestError(request_id, message))
                out.finished.append(_finished_record(request_id, token_times, None, "error"))
        for message in inputs:
            if isinstance(message, AddRequest):
                self._add(message, out)
            elif isinstance(message, SendKV):
                if not self.engine.send_kv(message.request_id, message.dst, message.tag):
                    logger.warning("no KV held for %s: not sent", message.request_id)
            else:
                for request_id in message.request_ids:
                    self._abort(request_id, out)
        if self.has_work():
            try:
                outputs = self.engine.step()
            except ExecutorDeadError:
                raise  # no later step can run: the core stops, and its requests end with engine_dead
            except Exception as exc:
                self._fail_step(exc, out)
            else:
                out.step = self._collect(outputs, out)
        out.output_time = time.perf_counter()
        out.state = self.engine.get_state()
        return out

    def _add(self, message: AddRequest, out: EngineStepOutputs) -> None:
        request = message.request
        try:
            self.engine.add_request(request)
        except ValueError as exc:
            out.errors.append(RequestError(request.request_id, str(exc), invalid=True))
            return
        except Exception as exc:
            logger.exception("adding request %s failed", request.request_id)
            out.errors.append(RequestError(request.request_id, f"the engine could not take the request: {exc}"))
            return
        kv = request.kv_transfer
        if kv is not None and kv.do_remote_prefill and kv.first_token_time is not None:
            self._token_times[request.request_id] = [[kv.first_token_time]]  # sampled on the prefill instance
        else:
            self._token_times[request.request_id] = [[] for _ in range(request.sampling_params.n)]
        out.accepted.append(request.request_id)

    def _abort(self, request_id: str, out: EngineStepOutputs) -> None:
        token_times = self._token_times.pop(request_id, None)
        if token_times is None:  # finished already (a prefill may still hold its KV), or never taken
            self.engine.release_kv(request_id)
            return
        outputs = self.engine.abort_request(request_id)
        out.outputs.extend(outputs)
        out.finished.append(_finished_record(request_id, token_times, outputs[-1] if outputs else None, "abort"))

    def _fail_step(self, exc: Exception, out: EngineStepOutputs) -> None:
        """A step raised: fail the requests it ran, and keep the others if the engine is still consistent
        without them (check_invariants); else fail every request of this core. The step's requests may
        have half-written KV, so they are not retried."""
        # A step that failed before it had a plan (in the scheduler) cannot say whose it was: fail them all.
        failed = [r for r in self.engine.failed_step_request_ids() if r in self._token_times] or list(self._token_times)
        logger.exception("engine step failed; failing its %d requests", len(failed))
        self._fail(failed, exc, out)
        try:
            self.engine.check_invariants()
        except Exception:
            logger.exception("the engine is inconsistent after a failed step; failing all %d requests",
                             len(self._token_times))
            self._fail(list(self._token_times), exc, out)

    def _fail(self, request_ids: list[str], exc: Exception, out: EngineStepOutputs) -> None:
        message = f"the engine step failed: {type(exc).__name__}: {exc}"
        for request_id in request_ids:
            token_times = self._token_times.pop(request_id)
            self.engine.abort_request(request_id)
            out.errors.append(RequestError(request_id, message))
            out.finished.append(_finished_record(request_id, token_times, None, "error"))
        if not self._token_times and self.engine.has_unfinished_requests():
            raise RuntimeError("requests the loop does not know of are left in the engine") from exc

    def _collect(self, outputs: list[RequestOutput], out: EngineStepOutputs) -> StepSample | None:
        now = time.perf_counter()
        num_generated = num_prompt = 0
        for output in outputs:
            token_times = self._token_times.get(output.request_id)
            if token_times is None:
                continue
            for completion in output.outputs:
                times = token_times[completion.index]
                num_new = len(completion.token_ids) - len(times)
                if num_new > 0:
                    if not times:
                        num_prompt += len(output.prompt_token_ids)
                    times.extend([now] * num_new)
                    num_generated += num_new
            out.outputs.append(output)
            if output.finished:
                del self._token_times[output.request_id]
                out.finished.append(_finished_record(output.request_id, token_times, output, None))
        stats = self.engine.last_step_stats
        if stats is None or stats is self._last_stats:
            return None
        self._last_stats = stats
        return StepSample(stats.duration, stats.num_scheduled_tokens, num_generated, num_prompt)


def _finished_record(request_id: str, token_times: list[list[float]], out: RequestOutput | None,
                     reason: str | None) -> FinishedRequest:
    if out is None:
        return FinishedRequest(request_id, [reason or "abort"] * len(token_times))
    timings = []
    for completion in out.outputs:
        times = token_times[completion.index]
        if times:
            timings.append(RequestTiming(len(out.prompt_token_ids), len(completion.token_ids),
                                         out.metrics.arrival_time, times[0], times[-1], times,
                                         out.metrics.first_scheduled_time))
    reasons = [reason or completion.finish_reason or "abort" for completion in out.outputs]
    return FinishedRequest(request_id, reasons, timings)
