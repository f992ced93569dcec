"""The load generator's client: streams OpenAI-compatible requests on the workload's arrival schedule
and records, per request, when it was sent and when each chunk with content came back.

Timing follows `vllm bench serve`: the clock of a request starts when it is sent (after any
--max-concurrency wait); TTFT is the first chunk with non-empty content (a chat stream's opening
role chunk has none), ITLs are the gaps between content chunks, and E2E is the last content chunk.
Output tokens come from the stream's `usage` chunk (stream_options.include_usage), else from
re-tokenizing the text. A request fails on a non-200 status, an error event in the stream, a
transport error or a stream with no content; its message is kept, never dropped. As vLLM's
aiohttp client, the timeout bounds a whole request. The transport is http_stream.py (a few microseconds
of CPU per event, against about a millisecond for httpx): the client runs beside the server it measures.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from typing import Callable

import msgspec

from servelab.bench import http_stream
from servelab.bench.datasets import BenchRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
# vllm bench serve's client timeout: long enough for any queue, short enough to end a hung run.
DEFAULT_TIMEOUT_S = 6 * 3600.0
NO_CONTENT_ERROR = "the stream ended without any content"


@dataclass(frozen=True)
class ClientConfig:
    base_url: str
    endpoint: str = "/v1/completions"
    model: str = ""
    api_key: str | None = None
    ignore_eos: bool = False
    timeout_s: float = DEFAULT_TIMEOUT_S

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0
    start: float = 0.0  # perf_counter when sent
    chunk_times: list[float] = field(default_factory=list)  # perf_counter of each chunk with content
    text: str = ""
    error: str = ""

    @property
    def success(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.start if self.chunk_times else 0.0

    @property
    def latency(self) -> float:
        return self.chunk_times[-1] - self.start if self.chunk_times else 0.0

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def request_body(config: ClientConfig, request: BenchRequest) -> dict:
    body: dict = {"model": config.model, "max_tokens": request.output_len, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}
    if config.endpoint == "/v1/chat/completions":
        prompt = request.prompt
        if not isinstance(prompt, str):
            raise ValueError("chat endpoints take text prompts (--prompt-format text)")
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True
    return body


def _error_message(status: int, body: bytes) -> str:
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode(errors="replace").strip()[:500]
    return f"HTTP {status}: {message}"


_decode = msgspec.json.Decoder().decode


def _chunk_text(data: dict) -> str:
    choice = data["choices"][0]
    if "delta" in choice:
        return choice["delta"].get("content") or ""
    return choice.get("text") or ""


async def send_request(config: ClientConfig, request: BenchRequest,
                       count_tokens: Callable[[str], int] | None = None) -> RequestResult:
    result = RequestResult(prompt_len=request.prompt_len)
    usage: dict = {}
    parts: list[str] = []
    body = msgspec.json.encode(request_body(config, request))
    result.start = time.perf_counter()
    try:
        async with asyncio.timeout(config.timeout_s):
            response = await http_stream.request("POST", config.base_url.rstrip("/") + config.endpoint,
                                                 {"Accept": "text/event-stream", **config.headers}, body)
            try:
                if response.status != 200:
                    result.error = _error_message(response.status, await response.read())
                    return result
                async for line, now in response.lines():
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        break
                    data = _decode(payload)
                    error = data.get("error")
                    if error:
                        result.error = ("stream error: "
                                        f"{error.get('message', error) if isinstance(error, dict) else error}")
                        break
                    usage = data.get("usage") or usage
                    text = _chunk_text(data) if data.get("choices") else ""
                    if text:
                        result.chunk_times.append(now)
                        parts.append(text)
            finally:
                response.close()
    except http_stream.HTTPStreamError as err:
        result.error = f"{err.kind}: {err}"
    except TimeoutError:
        result.error = f"ReadTimeout: no complete answer within {config.timeout_s:g} s"
    except (msgspec.DecodeError, AttributeError, KeyError, IndexError, TypeError) as err:
        result.error = f"{type(err).__name__}: {err}" if str(err) else type(err).__name__
    result.text = "".join(parts)
    if not result.error and not result.chunk_times:
        result.error = NO_CONTENT_ERROR
    if usage.get("prompt_tokens"):
        result.prompt_len = int(usage["prompt_tokens"])
    if usage.get("completion_tokens") is not None:
        result.output_len = int(usage["completion_tokens"])
    else:
        result.output_len = count_tokens(result.text) if count_tokens else len(result.chunk_times)
    return result


async def run_requests(config: ClientConfig, requests: list[BenchRequest], max_concurrency: int | None = None,
                       count_tokens: Callable[[str], int] | None = None,
                       progress=None) -> tuple[list[RequestResult], float, float, int]:
    """Send every request at its arrival time (seconds after the start). Returns the results in the
    requests' order, the start and end perf_counter, and the peak number of requests in flight."""
    limit = max_concurrency or len(requests)
    semaphore = asyncio.Semaphore(limit)
    in_flight = peak = 0
    start = time.perf_counter()

    async def one(request: BenchRequest) -> RequestResult:
        nonlocal in_flight, peak
        delay = start + request.arrival_time - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        async with semaphore:
            in_flight += 1
            peak = max(peak, in_flight)
            try:
                return await send_request(config, request, count_tokens)
            finally:
                in_flight -= 1
                if progress is not None:
                    progress.update(1)

    results = await asyncio.gather(*(one(r) for r in requests))
    end = time.perf_counter()
    return list(results), start, end, peak


async def first_model_id(base_url: str, api_key: str | None = None, timeout_s: float = 30.0) -> str:
    """The first model the server lists on /v1/models (what `--model` defaults to)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        async with asyncio.timeout(timeout_s):
            response = await http_stream.request("GET", base_url.rstrip("/") + "/v1/models", headers)
            try:
                status, body = response.status, await response.read()
            finally:
                response.close()
    except http_stream.HTTPStreamError as err:
        raise ValueError(f"cannot reach {base_url}: {err.kind}: {err}") from None
    except TimeoutError:
        raise ValueError(f"cannot reach {base_url}: no answer within {timeout_s:g} s") from None
    if status != 200:
        raise ValueError(f"cannot list models at {base_url}/v1/models: {_error_message(status, body)}")
    try:
        models = msgspec.json.decode(body).get("data") or []
    except (msgspec.DecodeError, AttributeError):
        raise ValueError(f"{base_url}/v1/models did not answer with a JSON object") from None
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


async def probe(config: ClientConfig, request: BenchRequest) -> None:
    """One request before the run, as vllm bench serve does: a wrong URL, key or endpoint fails here."""
    result = await send_request(config, request)
    if result.error and result.error != NO_CONTENT_ERROR:  # a model may well stop at once
        raise ValueError(f"the test request to {config.base_url}{config.endpoint} failed: {result.error}")
