"""The JSON schema that tool_choice "required" constrains the output to (vLLM's): a list of calls, each
{"name": one of the tools, "parameters": that tool's arguments}, one call unless parallel_tool_calls."""
from __future__ import annotations

from typing import Any

ANY_OBJECT: dict[str, Any] = {"type": "object"}


def required_tools_schema(functions: list[dict], parallel: bool) -> dict:
    """functions: OpenAI tool functions ({"name", "parameters"?})."""
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [f["name"]]},
                             "parameters": f.get("parameters") or ANY_OBJECT},
              "required": ["name", "parameters"], "additionalProperties": False} for f in functions]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema
