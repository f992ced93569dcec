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


def unsupported_media_type(content_type: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.UNSUPPORTED_MEDIA_TYPE,
                       f"Content-Type must be application/json, got {content_type[:100]!r}.",
                       code="unsupported_media_type")


def stream_reader_too_slow(max_unsent_tokens: int) -> OpenAIError:
    return OpenAIError(HTTPStatus.SERVICE_UNAVAILABLE,
                       f"The client read the stream too slowly: more than {max_unsent_tokens} generated tokens were "
                       "waiting to be sent (--max-unsent-tokens), so the request was aborted.",
                       type="server_error", code="slow_reader")


def client_closed() -> OpenAIError:
    """Nobody reads it: the request log's record of a client that left while its body was being read."""
    return OpenAIError(499, "The client closed the connection before its request was read.", code="client_closed")


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


def engine_step_failed(message: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, type="server_error", code="engine_step_failed")


def internal_error(message: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, type="server_error", code="internal_error")


class RequestBodyTooLarge(Exception):
    """Raised by the body-size guard when a body without (or lying about) Content-Length runs over."""


class RequestBodyTimeout(OpenAIError):
    """Raised by the body guard when the body has not fully arrived by --body-read-timeout. An OpenAIError, so
    that whichever route was reading (the API's or the lab's) answers it as the 408 it is."""

    def __init__(self, timeout_s: float) -> None:
        super().__init__(HTTPStatus.REQUEST_TIMEOUT, f"The request body did not arrive within {timeout_s:g} s.",
                         code="body_read_timeout")
