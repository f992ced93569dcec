"""Errors shared by every front-end: FieldError (a bad input value, named by field so that each front-end names it
in its own vocabulary) and OpenAIError (an HTTP error in OpenAI's body shape, for the gateway and the lab web API)."""
from __future__ import annotations

from typing import Callable


class FieldError(ValueError):
    """The message is a template whose {field} placeholders a front-end fills with its own name for each field:
    `--num-gpus` on the command line, `num_gpus` in a JSON body. str() uses the plain field names."""

    def __init__(self, template: str, *fields: str) -> None:
        self.template = template
        self.fields = fields
        super().__init__(self.render(str))

    @property
    def field(self) -> str | None:
        """The field the error is first about (an API error's `param`)."""
        return self.fields[0] if self.fields else None

    def render(self, name: Callable[[str], str]) -> str:
        return self.template.format_map({f: name(f) for f in self.fields})


def check_fields(checks: list[tuple[bool, str, tuple[str, ...]]]) -> None:
    """Raise a FieldError for the first (ok, template, fields) that is not ok."""
    for ok, template, fields in checks:
        if not ok:
            raise FieldError(template, *fields)


class OpenAIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", code: str | None = None,
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code
        self.param = param
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class ExecutorDeadError(RuntimeError):
    """The executor lost its devices or worker processes: no later step can run, and the engine core that
    owns it must stop (its requests end with an `engine_dead` error)."""
