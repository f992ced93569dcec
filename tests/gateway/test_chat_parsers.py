"""The chat output parsers: reasoning split out of <think> tags and Hermes tool calls, the same whether the
text arrives whole or a character at a time."""
from __future__ import annotations

import json

import pytest

from servelab.parsers import ChatOutputParser, required_tools_schema


def run(parser: ChatOutputParser, text: str, step: int | None) -> tuple[dict, list]:
    deltas = []
    pieces = [text] if step is None else [text[i:i + step] for i in range(0, len(text), step)] or [""]
    for i, piece in enumerate(pieces):
        deltas.append(parser.feed(piece, final=i == len(pieces) - 1))
    return parser.message(), deltas


@pytest.mark.parametrize("step", [None, 1, 3])
def test_reasoning_split(step):
    message, deltas = run(ChatOutputParser(reasoning="qwen3"), "<think>\nLet me see.\n</think>\n\nIt is 4.", step)
    assert message["reasoning_content"] == "\nLet me see.\n" and message["content"] == "It is 4."
    assert "".join(d.reasoning for d in deltas) == "\nLet me see.\n"
    assert "".join(d.content for d in deltas) == "It is 4."


@pytest.mark.parametrize("step", [None, 1, 4])
def test_reasoning_opened_by_the_template_and_plain_text(step):
    message, _ = run(ChatOutputParser(reasoning="deepseek_r1"), "thinking...</think>answer", step)
    assert (message["reasoning_content"], message["content"]) == ("thinking...", "answer")
    message, _ = run(ChatOutputParser(reasoning="qwen3"), "<th is not a tag", step)
    assert (message["reasoning_content"], message["content"]) == (None, "<th is not a tag")


@pytest.mark.parametrize("step", [None, 1, 5])
def test_hermes_tool_calls_stream_as_openai_deltas(step):
    text = ('Sure. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    message, deltas = run(ChatOutputParser(tool_mode="auto"), text, step)
    assert message["content"] == "Sure. "
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]] == [
        ("get_weather", {"city": "Paris"}), ("get_time", {})]
    streamed = [c for d in deltas for c in d.tool_calls]
    assert [c["index"] for c in streamed] == [0, 1] and all(c["id"].startswith("call_") for c in streamed)
    assert "".join(d.content for d in deltas) == "Sure. "


def test_a_broken_tool_call_stays_content():
    message, _ = run(ChatOutputParser(tool_mode="auto"), "<tool_call>not json</tool_call> ok", None)
    assert message["content"] == "<tool_call>not json</tool_call> ok" and "tool_calls" not in message


@pytest.mark.parametrize("step", [None, 2])
def test_named_and_required_modes(step):
    message, deltas = run(ChatOutputParser(tool_mode="named", tool_name="f"), '{"x": 1}', step)
    assert message["content"] is None and message["tool_calls"][0]["function"] == {"name": "f", "arguments": '{"x": 1}'}
    assert deltas[0].tool_calls[0]["function"]["name"] == "f"
    assert "".join(c["function"]["arguments"] for d in deltas for c in d.tool_calls) == '{"x": 1}'
    message, _ = run(ChatOutputParser(tool_mode="required"), '[{"name": "g", "parameters": {"y": "z"}}]', step)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message["tool_calls"]] == [("g", '{"y": "z"}')]


def test_required_schema_lists_the_tools():
    schema = required_tools_schema([{"name": "a", "parameters": {"type": "object"}}, {"name": "b"}], parallel=False)
    assert schema["maxItems"] == 1 and [c["properties"]["name"]["enum"] for c in schema["items"]["anyOf"]] == [["a"], ["b"]]
