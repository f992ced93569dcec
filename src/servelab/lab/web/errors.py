"""The lab web API's errors, in the same OpenAI body shape as the gateway's."""
from __future__ import annotations

from http import HTTPStatus

from servelab.errors import OpenAIError

RETRY_AFTER_S = 1


def bad_request(message: str, param: str | None = None) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, message, param=param)


def not_found(message: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND, message, code="not_found")


def request_too_large(limit: int) -> OpenAIError:
    return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                       f"Request body is larger than the lab's limit of {limit} bytes.", code="request_too_large")


def lab_busy() -> OpenAIError:
    return OpenAIError(HTTPStatus.TOO_MANY_REQUESTS, "The lab is running another simulation; retry when it is done.",
                       type="rate_limit_error", code="lab_busy", headers={"Retry-After": str(RETRY_AFTER_S)})


def internal_error(message: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message, type="server_error", code="internal_error")
