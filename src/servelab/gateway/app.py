"""The FastAPI app: routes, the gateway middleware (request ids, auth, draining, body size) and the
OpenAI-shaped error handlers. `Gateway` owns the pieces and their start/stop order."""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelab.gateway.admission import AdmissionControl
from servelab.gateway.async_llm import AsyncLLM
from servelab.gateway.auth import ApiKeyAuth
from servelab.gateway.config import ServerConfig
from servelab.gateway.errors import (OpenAIError, RequestBodyTimeout, RequestBodyTooLarge, engine_unavailable,
                                     internal_error, request_too_large, shutting_down, unauthorized)
from servelab.gateway.openapi import generation_route, install_openapi, models_route
from servelab.gateway.protocol import ChatCompletionRequest, CompletionRequest
from servelab.gateway.serving import OpenAIServing
from servelab.gateway.sse import SSEResponse, sse_event
from servelab.engine.core_client import EngineCoreClient
from servelab.metrics.recorder import MetricsRecorder, with_rates
from servelab.metrics.server_metrics import ServerMetrics
from servelab.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)
request_logger = logging.getLogger("servelab.requests")

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
METRICS_PATHS = ("/metrics", "/v1/metrics/stream")
MAX_REQUEST_ID_LEN = 128


class Gateway:
    """cores: started engine cores (their limits known); tokenizer: the model's, for the input processor."""

    def __init__(self, cores: list[EngineCoreClient], tokenizer: Tokenizer, config: ServerConfig,
                 model_path: str | None = None) -> None:
        self.config = config
        self.model_path = model_path
        info = cores[0].info
        self.metrics = ServerMetrics(config.model_name, info.weight_bytes_per_rank,
                                     min(c.info.limits.max_model_len for c in cores), num_engines=len(cores))
        self.recorder = MetricsRecorder(self.metrics)
        self.engine = AsyncLLM(cores, tokenizer, on_events=self.recorder.submit)
        self.admission = AdmissionControl(config.max_num_queued_requests, config.max_queued_tokens,
                                          on_reject=self.metrics.record_rejected)
        self.auth = ApiKeyAuth(config.api_keys)
        self.serving = OpenAIServing(self.engine, self.admission, config)
        self.closing = False  # set once the server is about to exit: long-lived streams end
        self.started_at = time.time()

    def start(self) -> None:
        self.recorder.start()
        self.engine.start()

    async def stop(self) -> None:
        self.closing = True
        await self.engine.shutdown()
        self.recorder.stop()

    async def wait_engine_dead(self) -> None:
        """Returns --shutdown-grace seconds after an engine core died. Meanwhile what was in flight has
        ended with `engine_dead`, /health and new requests get 503, and an orchestrator probing /health
        sees it; then the server should exit non-zero so that it is restarted."""
        await self.engine.dead.wait()
        logger.error("%s: answering 503 for %.1f s (--shutdown-grace), then exiting with status 1",
                     self.engine.dead_error, self.config.shutdown_grace)
        await asyncio.sleep(self.config.shutdown_grace)
        await self.admission.wait_idle(5.0)
        self.closing = True

    async def drain(self, grace_s: float) -> None:
        """Stop admitting (new requests get 503), let in-flight ones finish for up to grace_s, then fail
        whatever is left and return."""
        self.admission.draining = True
        logger.info("draining: %d requests in flight, up to %.1f s", self.admission.num_in_flight, grace_s)
        if not await self.admission.wait_idle(grace_s):
            logger.warning("shutdown grace over: aborting %d requests", self.admission.num_in_flight)
            self.engine.abort_all(OpenAIError(503, "The server shut down before the request finished.",
                                              type="server_error", code="shutting_down"))
            await self.admission.wait_idle(5.0)
        self.closing = True

    def snapshot(self) -> dict:
        snap = self.recorder.snapshot()
        snap.update(time=time.time(), uptime_s=time.time() - self.started_at,
                    num_requests_queued=self.admission.num_queued, num_queued_tokens=self.admission.num_queued_tokens,
                    num_requests_in_flight=self.admission.num_in_flight, draining=self.admission.draining,
                    weight_bytes=self.engine.weight_bytes, max_model_len=self.engine.max_model_len,
                    num_engines=self.engine.num_engines)
        return snap


class GatewayMiddleware:
    """Pure ASGI, so it wraps streaming responses without buffering them."""

    def __init__(self, app: ASGIApp, gateway: Gateway) -> None:
        self.app = app
        self.gateway = gateway

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        internal_id = uuid.uuid4().hex
        request_id = (headers.get("x-request-id") or "")[:MAX_REQUEST_ID_LEN] or internal_id
        state = scope.setdefault("state", {})
        state["request_id"], state["internal_request_id"] = request_id, internal_id

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        path = scope["path"]
        error = self._check(path, headers)
        if error is not None:
            if path in GENERATION_PATHS:
                request_logger.info(json.dumps({"event": "request", "request_id": None, "x_request_id": request_id,
                                                "endpoint": path, "status": error.status, "error": error.message},
                                               separators=(",", ":")))
            await _error_response(error)(scope, receive, send_with_id)
            return
        config = self.gateway.config
        receive = _time_limit_body(receive, config.body_read_timeout)
        if path in GENERATION_PATHS:
            receive = _limit_body(receive, config.max_request_bytes)
        await self.app(scope, receive, send_with_id)

    def _check(self, path: str, headers: Headers) -> OpenAIError | None:
        gw = self.gateway
        config = gw.config
        is_metrics = path in METRICS_PATHS
        protected = (config.protect_metrics if is_metrics else path.startswith("/v1/"))
        if protected and not gw.auth.check(headers.get("authorization")):
            return unauthorized()
        if path in GENERATION_PATHS:
            if gw.admission.draining:
                gw.metrics.record_rejected("draining")
                return shutting_down()
            length = headers.get("content-length")
            if length is not None and length.isdigit() and int(length) > config.max_request_bytes:
                return request_too_large(config.max_request_bytes)
        return None


def _limit_body(receive: Receive, limit: int) -> Receive:
    received = 0

    async def limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise RequestBodyTooLarge()
        return message

    return limited


def _time_limit_body(receive: Receive, timeout_s: float) -> Receive:
    """The whole body must arrive within timeout_s of the headers (a slowloris body gets 408); once it has,
    receive() is left alone (it then waits for the client's disconnect)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    body_done = False

    async def timed() -> Message:
        nonlocal body_done
        if body_done:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(0.0, deadline - asyncio.get_running_loop().time()))
        except asyncio.TimeoutError as exc:
            raise RequestBodyTimeout(timeout_s) from exc
        if message["type"] != "http.request" or not message.get("more_body", False):
            body_done = True
        return message

    return timed


def _error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


def build_app(gateway: Gateway, routers: tuple[APIRouter, ...] = ()) -> FastAPI:
    """The OpenAI API, /health and /metrics, plus the routers an entry point mounts beside them (the lab page)."""
    config = gateway.config

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    app = FastAPI(title="servelab", lifespan=lifespan)
    app.state.gateway = gateway
    app.add_middleware(GatewayMiddleware, gateway=gateway)
    if config.allowed_origins:  # added last, so outermost: preflights are answered before auth
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"])

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return _error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = OpenAIError(exc.status_code, str(exc.detail), type="invalid_request_error" if exc.status_code < 500
                            else "server_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return _error_response(internal_error(f"internal server error: {type(exc).__name__}"))

    @app.post("/v1/completions", **generation_route(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await gateway.serving.create_completion(request)

    @app.post("/v1/chat/completions", **generation_route(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await gateway.serving.create_chat_completion(request)

    @app.get("/v1/models", **models_route())
    async def models() -> dict:
        created = int(gateway.started_at)
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": created, "owned_by": "servelab",
             "root": gateway.model_path or config.model_name, "max_model_len": gateway.engine.max_model_len}
            for name in config.served_model_names]}

    @app.get("/health")
    async def health() -> Response:
        if gateway.admission.draining:
            return _error_response(shutting_down())
        engine = gateway.engine
        if not engine.is_running:
            return _error_response(engine_unavailable(engine.not_running_reason))
        # a step that failed ended only its own requests: still healthy, but say so
        return JSONResponse({"status": "ok", "num_failed_steps": engine.num_failed_steps,
                             "last_step_error": engine.last_step_error})

    @app.get("/metrics")
    async def metrics() -> Response:
        gateway.metrics.set_queued(gateway.admission.num_queued)
        return Response(generate_latest(gateway.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/metrics/stream")
    async def metrics_stream() -> Response:
        async def events():
            previous, previous_at = None, time.monotonic()
            while not gateway.closing:
                now = time.monotonic()
                snap = gateway.snapshot()
                yield sse_event(with_rates(snap, previous, now - previous_at))
                previous, previous_at = snap, now
                await asyncio.sleep(config.metrics_interval)

        return SSEResponse(events(), on_close=lambda: None)

    for router in routers:
        app.include_router(router)
    install_openapi(app, needs_api_key=gateway.auth.enabled)
    return app
