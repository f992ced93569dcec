"""One API call in flight: its context (ids, arrival, deadline), its engine requests, admission ticket
and outcome, and the merged stream of their outputs."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from typing import AsyncIterator

from starlette.requests import Request

from servelab.core.engine_io import EngineCoreRequest
from servelab.gateway.admission import Ticket
from servelab.engine.async_llm import AsyncLLM, EngineDeadError, EngineStepError
from servelab.engine.request_stream import RequestStream
from servelab.gateway.errors import (OpenAIError, engine_step_failed, engine_unavailable, internal_error,
                                     request_timeout, stream_reader_too_slow)
from servelab.outputs import RequestOutput
from servelab.sampling_params import SamplingParams

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("servelab.requests")
CLIENT_CLOSED = 499  # nginx's status for "the client went away first"


class ClientDisconnected(Exception):
    pass


class RequestContext:
    """Per HTTP request: ids, arrival time and deadline (set before the body is read)."""

    def __init__(self, http: Request, endpoint: str, id_prefix: str, timeout_s: float | None) -> None:
        self.http = http
        self.endpoint = endpoint
        self.arrival = time.perf_counter()
        loop = asyncio.get_running_loop()
        self.deadline = None if timeout_s is None else loop.time() + timeout_s
        self.timeout_s = timeout_s
        self.internal_id = http.scope.get("state", {}).get("internal_request_id") or uuid.uuid4().hex
        self.x_request_id = http.scope.get("state", {}).get("request_id", self.internal_id)
        self.request_id = f"{id_prefix}-{self.internal_id}"

    def engine_request_ids(self, num_prompts: int) -> list[str]:
        """One engine request per prompt."""
        return [self.request_id] if num_prompts == 1 else [f"{self.request_id}-{i}" for i in range(num_prompts)]

    def log(self, status: int, **fields) -> None:
        record = {"event": "request", "request_id": self.request_id, "x_request_id": self.x_request_id,
                  "endpoint": self.endpoint, "status": status, **fields,
                  "e2e_s": round(time.perf_counter() - self.arrival, 6)}
        request_logger.info(json.dumps(record, separators=(",", ":")))


class Job:
    """One API call: its engine requests (one per prompt, processed), admission ticket and outcome.
    close() runs exactly once however the call ends: it aborts what is unfinished, releases the ticket, logs."""

    def __init__(self, ctx: RequestContext, engine: AsyncLLM, ticket: Ticket, model: str,
                 requests: list[EngineCoreRequest], params: SamplingParams, stream: bool,
                 max_unsent_tokens: int | None = None) -> None:
        """max_unsent_tokens: for a stream, the most generated tokens of one prompt that may wait while the
        client is not reading; past it the prompt's request is aborted (its KV freed) with `slow_reader`."""
        self.ctx = ctx
        self.engine = engine
        self.ticket = ticket
        self.request_id = ctx.request_id
        self.model = model
        self.requests = requests
        self.params = params
        self.stream = stream
        self.streams: list[RequestStream] = []
        self.final: dict[int, RequestOutput] = {}  # per prompt, its output so far (the sum of its deltas)
        self.status = 200
        self.error: str | None = None
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self.max_unsent_tokens = max_unsent_tokens
        self._slow_aborted: set[int] = set()

    async def start(self) -> None:
        """Hand every request to the engine at once, then wait until it took them all."""
        self.streams = [self.engine.submit(r) for r in self.requests]
        try:
            await self._wait(asyncio.gather(*(s.accepted for s in self.streams)))
        except ValueError as exc:  # the input processor validated it: only misuse (a duplicate id) gets here
            raise internal_error(f"the engine refused the request: {exc}") from exc
        except asyncio.TimeoutError as exc:
            raise request_timeout(self.ctx.timeout_s) from exc
        except (EngineDeadError, EngineStepError) as exc:
            raise engine_error(exc) from exc

    async def _wait(self, awaitable) -> None:
        """Await until the request's deadline; asyncio.TimeoutError past it."""
        if self.ctx.deadline is None:
            await awaitable
        else:
            await asyncio.wait_for(awaitable, max(0.0, self.ctx.deadline - asyncio.get_running_loop().time()))

    async def outputs(self, watch_disconnect: bool = False) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(prompt index, delta: what that prompt's request gained since the last one) as they come, until every
        request finished. Raises OpenAIError on timeout or engine failure, ClientDisconnected when watching and
        the client left.

        The streams' news is taken as it arrives (their listener), not by a task per stream: the slow-reader
        check and the ticket see every delta even while this generator's consumer is blocked writing."""
        unsent: dict[int, RequestOutput] = {}  # per prompt, the deltas not yielded yet, summed
        errors: list[BaseException] = []
        wake = asyncio.Event()
        client_gone = timed_out = False

        def listener(index: int, stream: RequestStream):
            def take_news() -> None:
                try:
                    out = stream.take()
                    if out is None:
                        return
                    if any(c.token_ids for c in out.outputs):
                        self.ticket.started(index)
                    if index in unsent:
                        unsent[index].add(out)
                    else:
                        unsent[index] = out
                    self._check_unsent(index, unsent[index])
                except Exception as exc:
                    errors.append(exc)
                wake.set()
            return take_news

        def on_deadline() -> None:
            nonlocal timed_out
            timed_out = True
            wake.set()

        async def watch() -> None:
            nonlocal client_gone
            while (await self.ctx.http.receive())["type"] != "http.disconnect":
                pass
            client_gone = True
            wake.set()

        for index, stream in enumerate(self.streams):
            stream.listener = listener(index, stream)
            stream.listener()  # what came before this generator started
        if watch_disconnect:
            self._tasks.append(asyncio.create_task(watch()))
        deadline = None if self.ctx.deadline is None else asyncio.get_running_loop().call_at(self.ctx.deadline,
                                                                                             on_deadline)
        remaining = set(range(len(self.streams)))
        try:
            while remaining:
                if errors:
                    raise engine_error(errors[0])
                if client_gone:
                    raise ClientDisconnected()
                if not unsent:
                    if timed_out:
                        raise asyncio.TimeoutError()
                    wake.clear()
                    await wake.wait()
                    continue
                items = sorted(unsent.items())
                unsent.clear()
                for index, out in items:
                    if index in self.final:
                        self.final[index].add(out)
                    else:
                        self.final[index] = out.copy()
                    if out.finished:
                        remaining.discard(index)
                        completions = self.final[index].outputs
                        if any(c.finish_reason not in ("stop", "length") for c in completions):
                            raise internal_error("the engine ended the request without finishing it "
                                                 f"({', '.join(str(c.finish_reason) for c in completions)})")
                    yield index, out
        except asyncio.TimeoutError as exc:
            self.abort_unfinished()
            raise request_timeout(self.ctx.timeout_s) from exc
        finally:
            if deadline is not None:
                deadline.cancel()
            for stream in self.streams:
                stream.listener = None
            self._cancel_tasks()

    def _check_unsent(self, index: int, unsent: RequestOutput) -> None:
        """Runs while the consumer may be blocked writing to a client that stopped reading: the engine must
        not go on generating (and holding KV blocks) for it without bound."""
        limit = self.max_unsent_tokens
        if limit is None or unsent.finished or index in self._slow_aborted:
            return
        num_unsent = _num_tokens(unsent)
        if num_unsent > limit:
            self._slow_aborted.add(index)
            request_id = self.streams[index].request_id
            logger.warning(json.dumps({"event": "slow_reader_abort", "request_id": request_id,
                                       "x_request_id": self.ctx.x_request_id, "num_unsent_tokens": num_unsent,
                                       "max_unsent_tokens": limit}, separators=(",", ":")))
            self.engine.abort(request_id, stream_reader_too_slow(limit))

    def _cancel_tasks(self) -> None:
        for task in self._tasks:
            task.cancel()
        self._tasks = []

    def abort_unfinished(self) -> None:
        for stream in self.streams:
            if not stream.done:
                self.engine.abort(stream.request_id)

    def fail(self, exc: OpenAIError) -> None:
        self.status, self.error = exc.status, exc.message

    def usage(self) -> dict:
        prompt = sum(len(r.prompt_token_ids) for r in self.requests)
        completion = sum(len(c.token_ids) for out in self.final.values() for c in out.outputs)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def close(self, completed: bool = True, log: bool = True) -> None:
        if self._closed:
            return
        self._closed = True
        self._cancel_tasks()
        self.abort_unfinished()
        self.ticket.release()
        if not completed and self.status == 200:
            self.status, self.error = CLIENT_CLOSED, "client disconnected"
        if not log:
            return
        first = [s.first_token_time for s in self.streams if s.first_token_time is not None]
        reasons = [c.finish_reason for _, out in sorted(self.final.items()) for c in out.outputs]
        usage = self.usage()
        self.ctx.log(self.status, model=self.model, stream=self.stream,
                     n=self.params.n, prompt_tokens=usage["prompt_tokens"],
                     output_tokens=usage["completion_tokens"],
                     ttft_s=round(min(first) - self.ctx.arrival, 6) if first else None,
                     finish_reason=(reasons[0] if len(set(reasons)) == 1 else reasons) if reasons else None,
                     **({"error": self.error} if self.error else {}))


def _num_tokens(out: RequestOutput) -> int:
    return sum(len(c.token_ids) for c in out.outputs)


def engine_error(exc: BaseException) -> OpenAIError:
    if isinstance(exc, OpenAIError):
        return exc
    if isinstance(exc, EngineDeadError):
        return engine_unavailable(str(exc))
    if isinstance(exc, EngineStepError):
        return engine_step_failed(str(exc))
    return internal_error(str(exc))
