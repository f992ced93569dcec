"""The gateway's ASGI middleware: request ids, API keys, draining, and limits on how big a body may be and how
long it may take to arrive. Pure ASGI, so streaming responses pass through unbuffered."""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from typing import Callable
from starlette.datastructures import Headers
from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from servelab.gateway.admission import AdmissionControl
from servelab.gateway.auth import ApiKeyAuth
from servelab.gateway.config import ServerConfig
from servelab.gateway.errors import (OpenAIError, RequestBodyTimeout, RequestBodyTooLarge, request_too_large,
                                     shutting_down, unauthorized)

request_logger = logging.getLogger("servelab.requests")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
METRICS_PATHS = ("/metrics", "/v1/metrics/stream")
MAX_REQUEST_ID_LEN = 128


class GatewayMiddleware:
    """Runs before routing: refuses what needs no handler (a missing key, draining, a declared size over the
    limit) and wraps receive() with the body limits."""

    def __init__(self, app: ASGIApp, config: ServerConfig, auth: ApiKeyAuth, admission: AdmissionControl,
                 on_draining_reject: Callable[[], None]) -> None:
        self.app = app
        self.config = config
        self.auth = auth
        self.admission = admission
        self.on_draining_reject = on_draining_reject

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
            await error_response(error)(scope, receive, send_with_id)
            return
        config = self.config
        receive = _time_limit_body(receive, config.body_read_timeout)
        if path in GENERATION_PATHS:
            receive = _limit_body(receive, config.max_request_bytes)
        await self.app(scope, receive, send_with_id)

    def _check(self, path: str, headers: Headers) -> OpenAIError | None:
        config = self.config
        is_metrics = path in METRICS_PATHS
        protected = (config.protect_metrics if is_metrics else path.startswith("/v1/"))
        if protected and not self.auth.check(headers.get("authorization")):
            return unauthorized()
        if path in GENERATION_PATHS:
            if self.admission.draining:
                self.on_draining_reject()
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


def error_response(exc: OpenAIError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
