"""OpenAI request schemas (pydantic) and their translation to SamplingParams.

Unknown fields are ignored, as OpenAI does; known fields with the wrong JSON type are 400s (strict
validation: "5" is not an integer, 1.0 is not an integer, true is not a number).
"""
from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from servelab.gateway.config import ServerConfig
from servelab.gateway.errors import bad_request
from servelab.sampling_params import SamplingParams

# OpenAI's default for /v1/completions; chat defaults to "as much as the context allows".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM's extras
    top_k: int | None = None
    min_p: float | None = None
    ignore_eos: bool = False
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True

    def _common_checks(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")

    def check_limits(self, config: ServerConfig) -> None:
        """The server's limits on work one request may ask for (--max-n, --max-logprobs, --max-stop-strings,
        --max-stop-string-len), checked before anything is tokenized."""
        stops = [self.stop] if isinstance(self.stop, str) else (self.stop or [])
        logprobs = self.requested_logprobs
        if self.n > config.max_n:
            raise bad_request(f"n must be <= {config.max_n} (--max-n), got {self.n}", param="n")
        if logprobs is not None and logprobs > config.max_logprobs:
            raise bad_request(f"at most {config.max_logprobs} logprobs per token (--max-logprobs), got {logprobs}",
                              param=self.logprobs_param)
        if len(stops) > config.max_stop_strings:
            raise bad_request(f"at most {config.max_stop_strings} stop strings (--max-stop-strings), "
                              f"got {len(stops)}", param="stop")
        if any(len(s) > config.max_stop_string_len for s in stops):
            raise bad_request(f"a stop string may have at most {config.max_stop_string_len} characters "
                              "(--max-stop-string-len)", param="stop")

    @property
    def requested_logprobs(self) -> int | None:
        raise NotImplementedError

    logprobs_param: ClassVar[str] = "logprobs"

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = dict(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop, stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
        )
        try:
            return SamplingParams(**values)
        except ValueError as exc:
            message = str(exc)
            param = message.split(" ", 1)[0]
            raise bad_request(message, param=param if param in values else None) from exc

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_GenerationRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = COMPLETIONS_DEFAULT_MAX_TOKENS
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def check(self) -> None:
        self._common_checks()
        if self.best_of is not None and self.best_of != self.n:
            raise bad_request("best_of other than n is not supported", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")
        if self.echo and self.logprobs is not None:
            raise bad_request("echo with logprobs is not supported (prompt logprobs are not computed)",
                              param="echo")

    @property
    def requested_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def template_dict(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", param=f"messages[{index}].content")
            content = "".join(part.text for part in content)
        message = self.model_dump(exclude_none=True)
        message["content"] = content or ""
        return message


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True

    def check(self) -> None:
        self._common_checks()
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    logprobs_param: ClassVar[str] = "top_logprobs"

    @property
    def requested_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def sampling_params(self) -> SamplingParams:
        return self._sampling_params(self.requested_max_tokens, self.requested_logprobs)

    def template_messages(self) -> list[dict]:
        return [m.template_dict(i) for i, m in enumerate(self.messages)]


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def _param_path(loc: tuple) -> str | None:
    """('messages', 0, 'content', 'str') -> 'messages[0].content' (pydantic adds union-branch tags)."""
    parts: list[str] = []
    for p in loc:
        if isinstance(p, int):
            parts.append(f"[{p}]")
        elif not ("[" in p or "-" in p or p in _TYPE_TAGS):
            parts.append(("." if parts else "") + p)
    return "".join(parts) or None


def parse_request(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param_path(first["loc"])
        raise bad_request(f"{param or 'body'}: {first['msg']}", param=param) from exc
    request.check()
    return request


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    """Every error the API answers: OpenAI's shape (errors.OpenAIError.body())."""
    error: ErrorInfo
