"""Structured output and tool calling through the official openai client against a real `servelab serve`
(one tiny random-weight model server for the module): every sampled output matches its JSON schema,
streamed or not; tool calls come back as OpenAI tool_calls and go round again; bad and hostile schemas
are 400s naming the field."""
from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from servelab.testing.server import API_KEY, TINY_ENGINE_FLAGS

MODEL = "tiny-llama"
SCHEMAS = {
    "nested": {"type": "object", "additionalProperties": False, "required": ["name", "address"], "properties": {
        "name": {"type": "string", "maxLength": 12},
        "address": {"type": "object", "additionalProperties": False, "required": ["city", "zip"], "properties": {
            "city": {"type": "string", "maxLength": 10}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}}},
    "enums_and_arrays": {"type": "object", "additionalProperties": False, "required": ["color", "tags"], "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "minItems": 1, "maxItems": 3, "items": {"enum": ["a", "b", "c"]}}}},
    "bounded_numbers": {"type": "object", "additionalProperties": False, "required": ["count", "score"], "properties": {
        "count": {"type": "integer", "minimum": -5, "maximum": 5},
        "score": {"type": "number", "minimum": 0, "maximum": 10}}},
    "patterned_strings": {"type": "object", "additionalProperties": False, "required": ["code", "flag"], "properties": {
        "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}, "flag": {"type": "boolean"},
        "note": {"type": "string", "maxLength": 5}}},
}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"], "properties": {
        "city": {"type": "string", "maxLength": 16}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "additionalProperties": False, "required": ["zone"],
                                       "properties": {"zone": {"enum": ["UTC", "CET"]}}}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--api-key", API_KEY, "--served-model-name", MODEL,
                          "--reasoning-parser", "qwen3")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=120)


def response_format(name: str) -> dict:
    return {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True}}


@pytest.mark.parametrize("name", list(SCHEMAS))
def test_every_output_matches_its_schema(client, name):
    """25 sampled outputs per schema, 100 in all: 13 in one response, 12 streamed."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Reply in JSON."}],
                  response_format=response_format(name), temperature=1.0, seed=7, max_tokens=200)
    texts = {}
    for choice in client.chat.completions.create(n=13, **kwargs).choices:
        texts[choice.index] = (choice.message.content, choice.finish_reason)
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(n=12, stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    outputs = list(texts.values()) + [(streamed[i], finish[i]) for i in range(12)]
    assert len(outputs) == 25
    for text, finish_reason in outputs:
        assert finish_reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_guided_fields_and_completions(client):
    out = client.completions.create(model=MODEL, prompt="Pick:", max_tokens=20, extra_body={
        "guided_choice": ["alpha", "beta"]})
    assert out.choices[0].text in ("alpha", "beta")
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=20, temperature=0,
                                    extra_body={"guided_regex": "[A-Z]{2}[0-9]{3}"})
    assert len(out.choices[0].text) == 5 and out.choices[0].text[:2].isupper() and out.choices[0].text[2:].isdigit()
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=20, temperature=0, extra_body={
        "structured_outputs": {"grammar": 'root ::= "yes" | "no"'}})
    assert out.choices[0].message.content in ("yes", "no")
    # any object: a random model may ramble inside a free string until max_tokens, but it starts as one
    out = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=30, response_format={
        "type": "json_object"}, seed=1)
    text = out.choices[0].message.content
    assert text.startswith("{")
    if out.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)


class Person(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=120)


def test_parse_returns_the_pydantic_object(client):
    completion = client.chat.completions.parse(model=MODEL, messages=ASK, response_format=Person, max_tokens=100)
    assert isinstance(completion.choices[0].message.parsed, Person)


def _validate_call(call) -> dict:
    assert call.type == "function" and call.id
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}[call.function.name]
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, schema)
    return arguments


def _stream_tool_calls(stream) -> tuple[dict[int, dict], str]:
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or ():
                call = calls.setdefault(delta.index, {"id": None, "name": "", "arguments": ""})
                call["id"] = delta.id or call["id"]
                if delta.function.name:
                    call["name"] = delta.function.name
                call["arguments"] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return calls, finish


@pytest.mark.parametrize("stream", [False, True])
def test_tool_call_round_trip(client, stream):
    kwargs = dict(model=MODEL, tools=[WEATHER, TIME], tool_choice="required", max_tokens=120, seed=3)
    if stream:
        calls, finish = _stream_tool_calls(client.chat.completions.create(messages=ASK, stream=True, **kwargs))
        assert finish == "tool_calls" and calls
        tool_calls = [{"id": c["id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                      for _, c in sorted(calls.items())]
        for c in tool_calls:
            assert c["id"] and c["function"]["name"] in ("get_weather", "get_time")
            json.loads(c["function"]["arguments"])
    else:
        message = client.chat.completions.create(messages=ASK, **kwargs).choices[0]
        assert message.finish_reason == "tool_calls"
        for call in message.message.tool_calls:
            _validate_call(call)
        tool_calls = [c.model_dump() for c in message.message.tool_calls]
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": tool_calls}] + [
        {"role": "tool", "tool_call_id": c["id"], "content": '{"temperature": 21}'} for c in tool_calls]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[WEATHER, TIME], tool_choice="none",
                                            max_tokens=8, stream=stream)
    if stream:
        text = "".join(c.choices[0].delta.content or "" for c in answer if c.choices)
    else:
        text = answer.choices[0].message.content
        assert answer.choices[0].message.tool_calls is None
    assert isinstance(text, str)


@pytest.mark.parametrize("stream", [False, True])
def test_named_function_call_arguments_validate(client, stream):
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=120, temperature=1.0, seed=5,
                  tool_choice={"type": "function", "function": {"name": "get_weather"}})
    if stream:
        calls, finish = _stream_tool_calls(client.chat.completions.create(stream=True, **kwargs))
        assert finish == "stop" and list(calls) == [0] and calls[0]["name"] == "get_weather"
        jsonschema.validate(json.loads(calls[0]["arguments"]), WEATHER["function"]["parameters"])
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        _validate_call(choice.message.tool_calls[0])


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=60)


def _deep(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


BAD_SCHEMAS = {
    "wrong_type": {"type": 5},
    "unknown_type": {"type": "widget"},
    "empty_any_of": {"anyOf": []},
    "dangling_ref": {"$ref": "#/$defs/missing"},
    "self_ref": {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    "invalid_regex": {"type": "string", "pattern": "(["},
    "nested_deep": _deep(200),
    "enormous_enum": {"enum": [f"value-{i}" for i in range(50_000)]},
}


@pytest.mark.parametrize("name", list(BAD_SCHEMAS))
def test_bad_schema_is_a_400_naming_the_field(server, name):
    response = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": BAD_SCHEMAS[name]}}})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == "response_format"


def test_other_bad_grammars_and_fields_are_400s(server):
    cases = [
        ({"guided_regex": "a(b"}, "guided_regex"),
        ({"guided_grammar": "root ::= ("}, "guided_grammar"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
         "tools[0].function.parameters"),
        ({"seed": 2 ** 70}, "seed"),
        ({"seed": -(2 ** 64)}, "seed"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio"),
    ]
    for extra, param in cases:
        response = _post(server, "/v1/chat/completions", {"messages": ASK, "max_tokens": 5, **extra})
        assert response.status_code == 400, (extra, response.text)
        assert response.json()["error"]["param"] == param, (extra, response.text)


def test_tokenize_detokenize_and_logit_bias(client, server):
    tokenized = _post(server, "/tokenize", {"prompt": " banana", "add_special_tokens": False}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) >= 1 and tokenized["max_model_len"] > 0
    assert _post(server, "/detokenize", {"tokens": tokenized["tokens"]}).json() == {"prompt": " banana"}
    chat = _post(server, "/tokenize", {"messages": ASK}).json()
    assert chat["count"] > tokenized["count"]
    assert _post(server, "/detokenize", {"tokens": [10 ** 9]}).status_code == 400
    first = tokenized["tokens"][0]
    piece = _post(server, "/detokenize", {"tokens": [first]}).json()["prompt"]
    out = client.completions.create(model=MODEL, prompt="Fruit:", max_tokens=3, temperature=0,
                                    logit_bias={str(first): 100})
    assert out.choices[0].text == piece * 3


@pytest.mark.parametrize("stream", [False, True])
def test_auto_mode_parses_hermes_calls_out_of_the_text(client, stream):
    """tool_choice auto: the text is parsed for <tool_call> blocks (a grammar makes the tiny model write one)."""
    text = 'Checking. <tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], max_tokens=60,
                  extra_body={"structured_outputs": {"choice": [text]}})
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        calls, finish = _stream_tool_calls(iter(chunks))
        assert (content, finish) == ("Checking. ", "tool_calls")
        assert [(c["name"], json.loads(c["arguments"])) for c in calls.values()] == [("get_time", {"zone": "UTC"})]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert (choice.message.content, choice.finish_reason) == ("Checking. ", "tool_calls")
        assert _validate_call(choice.message.tool_calls[0]) == {"zone": "UTC"}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_is_split_out(client, stream):
    """--reasoning-parser qwen3: <think> text goes to reasoning_content (a grammar makes the tiny model think)."""
    kwargs = dict(model=MODEL, messages=ASK, max_tokens=40,
                  extra_body={"structured_outputs": {"choice": ["<think>\nIt rains.\n</think>\n\nTake a coat."]},
                              "chat_template_kwargs": {"enable_thinking": True}})
    if stream:
        chunks = [c for c in client.chat.completions.create(stream=True, **kwargs) if c.choices]
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks)
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        message = client.chat.completions.create(**kwargs).choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert (reasoning, content) == ("\nIt rains.\n", "Take a coat.")
