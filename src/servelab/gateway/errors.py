"""Errors the gateway answers with, in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""
from __future__ import annotations

from http import HTTPStatus

from servelab.errors import OpenAIError

__all__ = ["OpenAIError"]  # and the factories below


def bad_request(message: str, param: str | None = None, code: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param, code=code)


def unauthorized() -> OpenAIError:
    return OpenAIError(HTTPStatus.UNAUTHORIZED, "Incorrect or missing API key: send 'Authorization: Bearer <key>'.",
                       code="invalid_api_key")


def model_not_found(model: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND, f"The model `{model}` does not exist.", code="model_not_found",
                       param="model")


def request_too_large(limit: int) -> OpenAIError:
    return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       f"Request body is larger than the server's limit of {limit} bytes.", code="request_too_large")


def queue_full(reason: str, retry_after_s: int) -> OpenAIError:
    return OpenAIError(HTTPStatus.TOO_MANY_REQUESTS, f"The server is busy ({reason}); retry after {retry_after_s} s.",
                       type="rate_limit_error", code="queue_full", headers={"Retry-After": str(retry_after_s)})


def shutting_down() -> OpenAIError:
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, "The server is shutting down and accepts no new requests.",
                       type="server_error", code="shutting_down")


def engine_unavailable(detail: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE, f"The engine is not running: {detail}", type="server_error",
                       code="engine_dead")


def request_timeout(timeout_s: float) -> OpenAIError:
    return OpenAIError(HTTPStatus.GATEWAY_TIMEOUT, f"The request ran longer than the server's limit of {timeout_s:g} s.",
                       type="timeout_error", code="request_timeout")


def internal_error(message: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, type="server_error", code="internal_error")


class RequestBodyTooLarge(Exception):
    """Raised by the body-size guard when a body without (or lying about) Content-Length runs over."""
