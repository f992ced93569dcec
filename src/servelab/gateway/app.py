"""The FastAPI app: routes, the gateway middleware (request ids, auth, draining, body size) and the
OpenAI-shaped error handlers. `Gateway` owns the pieces and their start/stop order."""
from __future__ import annotations

import asyncio
import logging
import time
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI
from fastapi.middleware.cors import CORSMiddleware
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from servelab.gateway.admission import AdmissionControl
from servelab.engine.async_llm import AsyncLLM
from servelab.gateway.auth import ApiKeyAuth
from servelab.gateway.config import ServerConfig
from servelab.gateway.errors import OpenAIError, engine_unavailable, internal_error, shutting_down
from servelab.gateway.middleware import GatewayMiddleware, error_response
from servelab.gateway.openapi import generation_route, install_openapi, models_route
from servelab.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest
from servelab.gateway.serving import OpenAIServing
from servelab.gateway.sse import SSEResponse, sse_event
from servelab.engine.core_client import EngineCoreClient
from servelab.metrics.recorder import MetricsRecorder, with_rates
from servelab.metrics.server_metrics import ServerMetrics
from servelab.model.tokenizer import Tokenizer

logger = logging.getLogger(__name__)



class Gateway:
    """cores: started engine cores (their limits known); tokenizer: the model's, for the input processor."""

    def __init__(self, cores: list[EngineCoreClient], tokenizer: Tokenizer, config: ServerConfig,
                 model_path: str | None = None) -> None:
        self.config = config
        self.model_path = model_path
        info = cores[0].info
        self.engine_info = info  # the first core's EngineReady (every core runs the same flags)
        self.metrics = ServerMetrics(config.model_name, info.weight_bytes_per_rank,
                                     min(c.info.limits.max_model_len for c in cores), num_engines=len(cores))
        self.metrics.set_quantization(info.quantization, info.kv_cache_dtype, info.quantization_reason)
        self.recorder = MetricsRecorder(self.metrics)
        self.engine = AsyncLLM(cores, tokenizer, on_events=self.recorder.submit, router=config.router)
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
    app.add_middleware(GatewayMiddleware, config=config, auth=gateway.auth, admission=gateway.admission,
                       on_draining_reject=lambda: gateway.metrics.record_rejected("draining"))
    if config.allowed_origins:  # added last, so outermost: preflights are answered before auth
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"])

    @app.exception_handler(OpenAIError)
    async def openai_error(request: Request, exc: OpenAIError) -> Response:
        return error_response(exc)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        error = OpenAIError(exc.status_code, str(exc.detail), type="invalid_request_error" if exc.status_code < 500
                            else "server_error")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s", request.url.path)
        return error_response(internal_error(f"internal server error: {type(exc).__name__}"))

    @app.post("/v1/completions", **generation_route(CompletionRequest))
    async def completions(request: Request) -> Response:
        return await gateway.serving.create_completion(request)

    @app.post("/v1/chat/completions", **generation_route(ChatCompletionRequest))
    async def chat_completions(request: Request) -> Response:
        return await gateway.serving.create_chat_completion(request)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await gateway.serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await gateway.serving.detokenize(request)

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
            return error_response(shutting_down())
        engine = gateway.engine
        if not engine.is_running:
            return error_response(engine_unavailable(engine.not_running_reason))
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
