"""A second model family trained to call tools, served from a Hugging Face folder: a tiny random-weight Qwen2
(Qwen2.5's architecture) with Qwen2.5's chat template, which renders `tools` itself. The server passes the
tools to that template (not the Hermes system prompt it writes for templates without tools), a required call
comes back as valid tool_calls, and the call and the tool's answer go round through the template again."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest

from servelab.model.tokenizer import Tokenizer
from servelab.testing.server import API_KEY, TINY_ENGINE_FLAGS

TEMPLATE = Path(__file__).parent / "data" / "qwen2_5_chat_template.jinja"
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city"],
                   "properties": {"city": {"type": "string", "maxLength": 12}}}}}]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]


@pytest.fixture(scope="module")
def qwen_dir(tiny_qwen2_dir, tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen2_tools") / "tiny-qwen2.5"
    shutil.copytree(tiny_qwen2_dir, folder)
    shutil.copy(TEMPLATE, folder / "chat_template.jinja")
    return folder


@pytest.fixture(scope="module")
def client(start_server, qwen_dir):
    server = start_server(qwen_dir, *TINY_ENGINE_FLAGS, "--api-key", API_KEY)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    server.stop()


def prompt_tokens(qwen_dir: Path, messages: list[dict], tools: list[dict] | None) -> int:
    tokenizer = Tokenizer.from_pretrained(qwen_dir)
    return len(tokenizer.encode(tokenizer.apply_chat_template(messages, tools=tools), add_special_tokens=False))


def test_the_template_renders_the_tools_and_the_call_round_trips(client, qwen_dir):
    first = client.chat.completions.create(model="tiny-qwen2.5", messages=ASK, tools=TOOLS, tool_choice="required",
                                           max_tokens=60, temperature=0)
    assert first.usage.prompt_tokens == prompt_tokens(qwen_dir, ASK, TOOLS)
    assert "# Tools" in Tokenizer.from_pretrained(qwen_dir).apply_chat_template(ASK, tools=TOOLS)
    calls = first.choices[0].message.tool_calls
    assert first.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["get_weather"]
    jsonschema.validate(json.loads(calls[0].function.arguments), TOOLS[0]["function"]["parameters"])
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
                     {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    second = client.chat.completions.create(model="tiny-qwen2.5", messages=history, tools=TOOLS, max_tokens=5)
    template_history = ASK + [{"role": "assistant", "content": "", "tool_calls": [
        {"id": calls[0].id, "type": "function", "function": {
            "name": "get_weather", "arguments": json.loads(calls[0].function.arguments)}}]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "sunny"}]
    assert second.usage.prompt_tokens == prompt_tokens(qwen_dir, template_history, TOOLS)
