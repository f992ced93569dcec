"""The OpenAPI schema of /v1/*: FastAPI generates it from the routes; the request bodies and the error
body are the pydantic models the handlers validate with (protocol.py), so the schema says what the
handlers accept, and the responses list every status a handler can answer. Schemathesis fuzzes the
server against it (tests/gateway/test_fuzz_schema.py)."""
from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel
from pydantic.json_schema import models_json_schema

from servelab.gateway.openai.protocol import ChatCompletionRequest, CompletionRequest, ErrorResponse

REF = "#/components/schemas/{model}"
_ERROR = {"application/json": {"schema": {"$ref": REF.format(model="ErrorResponse")}}}


def _error(description: str) -> dict:
    return {"description": description, "content": _ERROR}


def generation_route(request_model: type[BaseModel]) -> dict[str, Any]:
    """FastAPI route kwargs for /v1/completions and /v1/chat/completions."""
    return {
        "openapi_extra": {"requestBody": {"required": True, "content": {
            "application/json": {"schema": {"$ref": REF.format(model=request_model.__name__)}}}}},
        "responses": {
            200: {"description": "The completion (JSON), or its chunks as server-sent events when stream is true",
                  "content": {"application/json": {"schema": {"type": "object"}},
                              # one server-sent event: `data: {json chunk}`, the last one `data: [DONE]`
                              "text/event-stream": {"schema": {"type": "object", "required": ["data"],
                                                               "properties": {"data": {"type": "string"}}}}}},
            400: _error("Invalid request: malformed JSON, a wrong type, a value out of range or past a limit, "
                        "or a prompt longer than the context"),
            401: _error("Missing or wrong API key (when the server has keys)"),
            404: _error("Unknown model"),
            408: _error("The body did not arrive within --body-read-timeout"),
            413: _error("The body is larger than --max-request-bytes"),
            415: _error("Content-Type is not application/json"),
            429: _error("The queue is full (--max-num-queued-requests / --max-queued-tokens); see Retry-After"),
            500: _error("An engine step failed (a fault, never the request's doing); the server keeps serving"),
            503: _error("The server is draining or its engine is not running (engine_dead)"),
            504: _error("The request ran past --request-timeout"),
        },
    }


def models_route() -> dict[str, Any]:
    return {"responses": {401: _error("Missing or wrong API key (when the server has keys)")}}


def install_openapi(app: FastAPI, needs_api_key: bool) -> None:
    """app.openapi() adds the request and error models, and the bearer scheme when the server has keys."""

    def openapi() -> dict:
        if app.openapi_schema:
            return app.openapi_schema
        schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
        _, defs = models_json_schema([(CompletionRequest, "validation"), (ChatCompletionRequest, "validation"),
                                      (ErrorResponse, "serialization")], ref_template=REF)
        components = schema.setdefault("components", {})
        components.setdefault("schemas", {}).update(defs["$defs"])
        if needs_api_key:
            components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
            for path, operations in schema["paths"].items():
                if path.startswith("/v1/"):
                    for operation in operations.values():
                        operation["security"] = [{"bearer": []}]
        app.openapi_schema = schema
        return schema

    app.openapi = openapi
