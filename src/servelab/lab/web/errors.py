"""The lab web API's errors, in the same OpenAI body shape as the gateway's, worded in the request's language."""
from __future__ import annotations

from http import HTTPStatus

from servelab.errors import OpenAIError
from servelab.lab.web.i18n import Message
from servelab.lab.web.params import LabInputError

RETRY_AFTER_S = 1


def bad_request(err: LabInputError, lang: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.BAD_REQUEST, err.message.render(lang), param=err.param)


def not_found(name: str, lang: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND, Message("no_asset", {"name": repr(name)}).render(lang), code="not_found")


def measure_unavailable(lang: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.NOT_FOUND, Message("measure_needs_serve").render(lang), code="not_found")


def request_too_large(limit: int, lang: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, Message("too_large", {"limit": limit}).render(lang),
                       code="request_too_large")


def lab_busy(lang: str) -> OpenAIError:
    return OpenAIError(HTTPStatus.TOO_MANY_REQUESTS, Message("busy").render(lang), type="rate_limit_error",
                       code="lab_busy", headers={"Retry-After": str(RETRY_AFTER_S)})


def internal_error(command: str, err: Exception, lang: str) -> OpenAIError:
    message = Message("internal", {"command": command, "error": f"{type(err).__name__}: {err}"})
    return OpenAIError(HTTPStatus.INTERNAL_SERVER_ERROR, message.render(lang), type="server_error",
                       code="internal_error")
