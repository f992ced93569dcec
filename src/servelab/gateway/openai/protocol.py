"""OpenAI request schemas (pydantic) and their translation to SamplingParams.

Every field of OpenAI's chat and completions requests (and vLLM's extras) is declared: it is honoured, or a
value the server cannot honour is a 400 naming it (REFUSED_CHAT_FIELDS). Unknown fields are ignored, as
OpenAI does, and logged once per name; known fields with the wrong JSON type are 400s (strict validation:
"5" is not an integer, 1.0 is not an integer, true is not a number).
"""
from __future__ import annotations

import json
import logging
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from servelab.gateway.config import ServerConfig
from servelab.gateway.errors import bad_request
from servelab.gateway.openai.protocol_structured import StructuredFields, ToolFields
from servelab.sampling_params import SamplingParams, StructuredOutputsParams

logger = logging.getLogger(__name__)

INT64_MIN, UINT64_MAX = -(1 << 63), (1 << 64) - 1
# Fields whose values are schemas (any JSON): not walked for out-of-range integers.
_SCHEMA_FIELDS = ("response_format", "structured_outputs", "guided_json", "tools", "messages", "prompt",
                  "chat_template_kwargs", "metadata")
_MAX_LOGGED_UNKNOWN = 1000
_logged_unknown: set[str] = set()

# OpenAI's default for /v1/completions; chat defaults to "as much as the context allows".
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(StructuredFields):
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
        if self.seed is not None and not INT64_MIN <= self.seed < (1 << 63):
            raise bad_request("seed must be a 64-bit signed integer", param="seed")
        if self.stream_options is not None and not self.stream:
            raise bad_request("stream_options is only allowed when stream is true", param="stream_options")
        self.token_logit_bias()

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

    def token_logit_bias(self) -> dict[int, float] | None:
        """logit_bias with its keys as token ids (OpenAI sends them as strings)."""
        if not self.logit_bias:
            return None
        try:
            bias = {int(token): value for token, value in self.logit_bias.items()}
        except ValueError as exc:
            raise bad_request("logit_bias keys must be token ids", param="logit_bias") from exc
        if any(not -100 <= v <= 100 for v in bias.values()):
            raise bad_request("logit_bias values must be in [-100, 100]", param="logit_bias")
        return bias

    def output_grammar(self) -> tuple[str, StructuredOutputsParams] | None:
        """(the field it came from, the grammar) constraining the output, if any."""
        return self.structured_output()

    def _sampling_params(self, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
        values: dict[str, Any] = dict(
            n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0,
            min_p=self.min_p or 0.0, seed=self.seed, presence_penalty=self.presence_penalty or 0.0,
            frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            stop=self.stop, stop_token_ids=self.stop_token_ids or [], ignore_eos=self.ignore_eos,
            max_tokens=max_tokens, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            logit_bias=self.token_logit_bias(),
        )
        grammar = self.output_grammar()
        if grammar is not None:
            values["structured_outputs"] = grammar[1]
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


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    name: str
    arguments: str


class MessageToolCall(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None  # an assistant's earlier calls, sent back
    tool_call_id: str | None = None  # a tool message's answer to that call

    def template_dict(self, index: int) -> dict:
        content = self.content
        if isinstance(content, list):
            if any(part.type != "text" or part.text is None for part in content):
                raise bad_request("only text content parts are supported", param=f"messages[{index}].content")
            content = "".join(part.text for part in content)
        message = self.model_dump(exclude_none=True)
        message["content"] = content or ""
        if self.tool_calls:
            # Templates read the arguments as a mapping (vLLM passes them so too).
            message["tool_calls"] = [{"id": c.id, "type": "function",
                                      "function": {"name": c.function.name,
                                                   "arguments": _json_or_text(c.function.arguments)}}
                                     for c in self.tool_calls]
        return message


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


# OpenAI chat fields this server cannot honour: a request that sets one (to other than its default) is a 400.
REFUSED_CHAT_FIELDS = {
    "audio": "audio output is not supported",
    "functions": "functions is deprecated and not supported; send tools instead",
    "function_call": "function_call is deprecated and not supported; send tool_choice instead",
    "moderation": "moderation is not supported",
    "prediction": "predicted outputs are not supported",
    "verbosity": "verbosity is not supported",
    "web_search_options": "web search is not supported",
}
# OpenAI chat fields that are hints or labels with nothing for this server to do (prefix caching is automatic).
ACCEPTED_CHAT_HINTS = ("metadata", "prompt_cache_key", "prompt_cache_options", "prompt_cache_retention",
                       "safety_identifier", "user")


class ChatCompletionRequest(_GenerationRequest, ToolFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: str | None = None  # passed to the chat template, as vLLM does
    modalities: list[str] | None = None
    service_tier: str | None = None
    store: bool | None = None
    # hints and labels (ACCEPTED_CHAT_HINTS)
    metadata: dict[str, Any] | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    # refused unless unset (REFUSED_CHAT_FIELDS)
    audio: Any = None
    functions: Any = None
    function_call: Any = None
    moderation: Any = None
    prediction: Any = None
    verbosity: Any = None
    web_search_options: Any = None

    def check(self) -> None:
        self._common_checks()
        if not self.messages:
            raise bad_request("messages must not be empty", param="messages")
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs needs logprobs set to true", param="top_logprobs")
        for name, message in REFUSED_CHAT_FIELDS.items():
            if getattr(self, name) is not None:
                raise bad_request(message, param=name)
        if self.modalities is not None and self.modalities != ["text"]:
            raise bad_request("only the text modality is supported", param="modalities")
        if self.service_tier not in (None, "auto", "default"):
            raise bad_request(f"service_tier {self.service_tier!r} is not offered; use auto or default",
                              param="service_tier")
        if self.store:
            raise bad_request("stored completions are not supported (store must be false)", param="store")
        self.check_tools()

    def output_grammar(self) -> tuple[str, StructuredOutputsParams] | None:
        sources = self.grammar_sources()
        tool_grammar = self.tool_grammar()
        if tool_grammar is not None:
            sources.append(tool_grammar)
        if len(sources) > 1:
            names = ", ".join(name for name, _ in sources)
            raise bad_request(f"only one of these fields may constrain the output, got {names}",
                              param=sources[1][0])
        return sources[0] if sources else None

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            kwargs.setdefault("reasoning_effort", self.reasoning_effort)
        return kwargs

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


def _check_integers(body: dict) -> None:
    """Integers must fit in 64 bits (a seed past them was a 500 from the engine's message codec)."""
    for key, value in body.items():
        if key in _SCHEMA_FIELDS:
            continue
        stack = [value]
        while stack:
            item = stack.pop()
            if isinstance(item, bool):
                continue
            if isinstance(item, int) and not INT64_MIN <= item <= UINT64_MAX:
                raise bad_request(f"{key}: integers must fit in 64 bits", param=key)
            if isinstance(item, list):
                stack.extend(item)
            elif isinstance(item, dict):
                stack.extend(item.values())


def _log_unknown(model: type[BaseModel], body: dict) -> None:
    known = {f.alias or name for name, f in model.model_fields.items()}
    for key in body:
        if key not in known and key not in _logged_unknown and len(_logged_unknown) < _MAX_LOGGED_UNKNOWN:
            _logged_unknown.add(key)
            logger.warning("ignoring unknown request field %r (logged once)", key[:100])


def parse_request(model: type[_Strict], body: Any) -> Any:
    """Validate a decoded JSON body; the first problem becomes a 400 naming the field."""
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    _check_integers(body)
    _log_unknown(model, body)
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
