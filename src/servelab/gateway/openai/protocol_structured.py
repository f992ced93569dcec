"""The request fields that shape what the model may say: response_format, vLLM's structured_outputs and
guided_* fields, tools and tool_choice. Each becomes at most one StructuredOutputsParams (a grammar); two
that would both constrain the output are a 400."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from servelab.gateway.errors import bad_request
from servelab.parsers import required_tools_schema
from servelab.sampling_params import StructuredOutputsParams

_FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
ANY_JSON_OBJECT = '{"type": "object"}'


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class JsonSchemaFormat(_Strict):
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsRequest(_Strict):
    """vLLM's structured_outputs: exactly one of its fields."""
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


def _json_text(value: dict | str, param: str) -> str:
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value)
    except RecursionError as exc:
        raise bad_request(f"{param}: the schema is nested too deeply", param=param) from exc


def _one(sources: list[tuple[str, StructuredOutputsParams]]) -> tuple[str, StructuredOutputsParams] | None:
    if len(sources) > 1:
        names = ", ".join(name for name, _ in sources)
        raise bad_request(f"only one of these fields may constrain the output, got {names}", param=sources[1][0])
    return sources[0] if sources else None


class StructuredFields(_Strict):
    """Mixed into both the completions and the chat request."""
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsRequest | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None

    def grammar_sources(self) -> list[tuple[str, StructuredOutputsParams]]:
        """(the field it came from, the grammar) for each field that constrains the output."""
        sources = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            sources.append(("response_format", StructuredOutputsParams("json", ANY_JSON_OBJECT)))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise bad_request("response_format of type json_schema needs json_schema.schema",
                                  param="response_format.json_schema")
            sources.append(("response_format", StructuredOutputsParams(
                "json", _json_text(rf.json_schema.schema_, "response_format"))))
        so = self.structured_outputs
        if so is not None:
            fields = [(name, value) for name, value in (("json", so.json_), ("regex", so.regex), ("choice", so.choice),
                                                         ("grammar", so.grammar), ("json_object", so.json_object))
                      if value not in (None, False)]
            if len(fields) != 1:
                raise bad_request("structured_outputs must set exactly one of json, regex, choice, grammar, "
                                  "json_object", param="structured_outputs")
            name, value = fields[0]
            sources.append((f"structured_outputs.{name}", _params(name, value, f"structured_outputs.{name}")))
        for name, value in (("json", self.guided_json), ("regex", self.guided_regex),
                            ("choice", self.guided_choice), ("grammar", self.guided_grammar)):
            if value is not None:
                sources.append((f"guided_{name}", _params(name, value, f"guided_{name}")))
        if self.guided_decoding_backend not in (None, "auto", "guidance", "llguidance"):
            raise bad_request(f"guided_decoding_backend {self.guided_decoding_backend!r} is not available; this "
                              "server constrains output with llguidance", param="guided_decoding_backend")
        return sources

    def structured_output(self) -> tuple[str, StructuredOutputsParams] | None:
        return _one(self.grammar_sources())


def _params(kind: str, value: Any, param: str) -> StructuredOutputsParams:
    if kind == "json_object":
        return StructuredOutputsParams("json", ANY_JSON_OBJECT)
    if kind == "json":
        return StructuredOutputsParams("json", _json_text(value, param))
    if kind == "choice":
        if not value:
            raise bad_request(f"{param} must not be empty", param=param)
        return StructuredOutputsParams("choice", json.dumps(value))
    return StructuredOutputsParams(kind, value)


class ToolFields(_Strict):
    """The chat request's tools; tool_choice "required" or a named function constrain the output."""
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def check_tools(self) -> None:
        names = set()
        for i, tool in enumerate(self.tools or ()):
            if not _FUNCTION_NAME.match(tool.function.name):
                raise bad_request("a function name must be 1 to 64 letters, digits, underscores or dashes",
                                  param=f"tools[{i}].function.name")
            names.add(tool.function.name)
        choice = self.tool_choice
        if choice not in (None, "none", "auto") and not self.tools:
            raise bad_request("tool_choice other than none or auto needs tools", param="tool_choice")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(f"tool_choice names function {choice.function.name!r}, which is not in tools",
                              param="tool_choice")

    @property
    def tool_mode(self) -> str | None:
        """How the output is read for tool calls: None, "auto", "required" or "named"."""
        if not self.tools or self.tool_choice == "none":
            return None
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"

    @property
    def named_tool(self) -> str | None:
        return self.tool_choice.function.name if isinstance(self.tool_choice, NamedToolChoice) else None

    def tool_grammar(self) -> tuple[str, StructuredOutputsParams] | None:
        mode = self.tool_mode
        if mode == "named":
            function = next(t.function for t in self.tools or () if t.function.name == self.named_tool)
            schema = (_json_text(function.parameters, "tool_choice") if function.parameters is not None
                      else ANY_JSON_OBJECT)
            return "tool_choice", StructuredOutputsParams("json", schema)
        if mode == "required":
            functions = [t.function.model_dump() for t in self.tools or ()]
            parallel = self.parallel_tool_calls is not False
            return "tool_choice", StructuredOutputsParams(
                "json", _json_text(required_tools_schema(functions, parallel), "tools"))
        return None

    def function_schemas(self) -> list[tuple[str, StructuredOutputsParams]]:
        """Each function's parameters as a grammar, to be checked (a bad one is a 400 naming it)."""
        return [(f"tools[{i}].function.parameters", StructuredOutputsParams(
                    "json", _json_text(t.function.parameters, f"tools[{i}].function.parameters")))
                for i, t in enumerate(self.tools or ()) if t.function.parameters is not None]
