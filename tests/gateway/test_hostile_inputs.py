"""Hostile and odd inputs against the real gateway process (stub engine) on 127.0.0.1: each gets a
documented 4xx with an OpenAI error body, or is served correctly, and the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import socket

import httpx
import pytest

HEADER_TIMEOUT_S = 1.0
BODY_TIMEOUT_S = 1.0
MAX_STOP_STRINGS = 64  # the defaults: the server runs without limit flags
MAX_N = 16


@pytest.fixture(scope="module")
def server(start_stub_server):
    return start_stub_server("--header-read-timeout", str(HEADER_TIMEOUT_S),
                             "--body-read-timeout", str(BODY_TIMEOUT_S))


def post(server, body, path="/v1/completions", headers=None, raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return httpx.post(f"{server.url}{path}", content=content,
                      headers={"Content-Type": "application/json", **(headers or {})}, timeout=30)


def error_of(response: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param, error
    if code is not None:
        assert error["code"] == code, error
    return error


def assert_still_serving(server) -> None:
    response = post(server, {"prompt": "hi", "max_tokens": 3})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " w1 w2 w3"


def test_json_nested_thousands_deep(server):
    error_of(post(server, None, raw=b"[" * 100_000 + b"]" * 100_000), 400)
    deep_field = b'{"prompt": "hi", "user": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    error_of(post(server, None, raw=deep_field), 400)
    deep_chat = b'{"messages": [{"role": "user", "content": "hi", "extra": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000
    error_of(post(server, None, path="/v1/chat/completions", raw=deep_chat + b"}]}"), 400)
    assert_still_serving(server)


def test_invalid_utf8(server):
    error_of(post(server, None, raw=b'{"prompt": "hi \xff\xfe", "max_tokens": 2}'), 400)
    error_of(post(server, None, raw=b'\xc3\x28{"prompt": "hi"}'), 400)
    assert_still_serving(server)


def test_slowloris_headers_are_cut_off_and_others_are_served(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        closed = False
        for _ in range(60):  # one header byte every 0.5 s: never finishes on its own
            assert_still_serving(server)
            try:
                sock.sendall(b"X")
                sock.settimeout(0.5)
                closed = sock.recv(1024) == b""
            except socket.timeout:
                continue
            except (BrokenPipeError, ConnectionResetError):
                closed = True
            if closed:
                break
        assert closed, "the server kept a connection whose headers never ended"
    assert_still_serving(server)


def test_slowloris_body_gets_408(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{\"prompt\": ")
        response = b""
        while b"\r\n\r\n" not in response or not response.endswith(b"}"):
            chunk = sock.recv(4096)
            if not chunk:
                break
            response += chunk
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408"), response
    assert json.loads(body)["error"]["code"] == "body_read_timeout"
    assert_still_serving(server)


def test_100k_character_prompts(server):
    many_words = "hi " * 33_334  # 33,334 tokens: past the context
    error_of(post(server, {"prompt": many_words, "max_tokens": 1}), 400, code="context_length_exceeded")
    error_of(post(server, {"messages": [{"role": "user", "content": many_words}]}, path="/v1/chat/completions"),
             400, code="context_length_exceeded")
    one_word = "x" * 100_000  # one unknown token
    response = post(server, {"prompt": one_word, "max_tokens": 2})
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 1


def test_n_at_and_past_its_limit(server):
    response = post(server, {"prompt": "hi", "max_tokens": 2, "n": MAX_N})
    assert response.status_code == 200 and len(response.json()["choices"]) == MAX_N
    error_of(post(server, {"prompt": "hi", "n": MAX_N + 1}), 400, param="n")
    error_of(post(server, {"prompt": "hi", "n": 0}), 400, param="n")
    error_of(post(server, {"prompt": "hi", "n": 10**30}), 400, param="n")


def test_logprobs_at_and_past_their_limit(server):
    response = post(server, {"prompt": "hi", "max_tokens": 2, "logprobs": 20})
    assert response.status_code == 200, response.text
    error_of(post(server, {"prompt": "hi", "logprobs": 21}), 400, param="logprobs")
    error_of(post(server, {"prompt": "hi", "logprobs": -1}), 400, param="logprobs")
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True}
    response = post(server, {**chat, "top_logprobs": 20}, path="/v1/chat/completions")
    assert response.status_code == 200, response.text
    error_of(post(server, {**chat, "top_logprobs": 21}, path="/v1/chat/completions"), 400, param="top_logprobs")


def test_hundreds_of_stop_strings(server):
    stops = [f"never{i}" for i in range(MAX_STOP_STRINGS - 1)] + ["w3"]
    response = post(server, {"prompt": "hi", "max_tokens": 8, "stop": stops})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == " w1 w2 "
    error_of(post(server, {"prompt": "hi", "stop": [f"s{i}" for i in range(300)]}), 400, param="stop")
    error_of(post(server, {"prompt": "hi", "stop": ["x" * 257]}), 400, param="stop")


def test_unicode_and_control_characters_in_stop_strings(server):
    odd = ["\u0000", "\x1b[31m", "\r\n", "日本語", "🙂", "\u202e", "\ud7ff", "\t"]
    for stream in (False, True):
        response = post(server, {"prompt": "hi", "max_tokens": 4, "stop": odd, "stream": stream})
        assert response.status_code == 200, response.text
    response = post(server, {"prompt": "hi", "max_tokens": 4, "stop": odd})
    assert response.json()["choices"][0]["text"] == " w1 w2 w3 w4"
    error_of(post(server, {"prompt": "hi", "stop": [""]}), 400, param="stop")


def test_max_tokens_zero_negative_and_huge(server):
    for value in (0, -1, -(2**63)):
        error_of(post(server, {"prompt": "hi", "max_tokens": value}), 400, param="max_tokens")
    for value in (10**9, 2**64 - 1):
        error_of(post(server, {"prompt": "hi", "max_tokens": value}), 400, code="context_length_exceeded")
    error_of(post(server, {"prompt": "hi", "max_tokens": 2**64}), 400, param="max_tokens")  # past 64 bits
    chat = {"messages": [{"role": "user", "content": "hi"}]}
    error_of(post(server, {**chat, "max_tokens": 0}, path="/v1/chat/completions"), 400, param="max_tokens")
    error_of(post(server, {**chat, "max_completion_tokens": 10**9}, path="/v1/chat/completions"), 400,
             code="context_length_exceeded")
    error_of(post(server, {"prompt": "hi", "max_tokens": 1.5}), 400, param="max_tokens")


def test_duplicate_x_request_ids_are_two_requests(server):
    async def both():
        async with httpx.AsyncClient(timeout=30) as http:
            return await asyncio.gather(*(
                http.post(f"{server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 4, "stream": s},
                          headers={"X-Request-Id": "same-id"}) for s in (False, True, False)))

    responses = asyncio.run(both())
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert all(r.headers["x-request-id"] == "same-id" for r in responses)
    assert responses[0].json()["choices"][0]["text"] == responses[2].json()["choices"][0]["text"] == " w1 w2 w3 w4"
    lines = [line for line in server.request_log_lines() if line["x_request_id"] == "same-id"]
    assert len(lines) == 3 and len({line["request_id"] for line in lines}) == 3
    assert all(line["status"] == 200 for line in lines)


def test_wrong_content_type(server):
    body = json.dumps({"prompt": "hi", "max_tokens": 2}).encode()
    for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        error_of(post(server, None, raw=body, headers={"Content-Type": content_type}), 415,
                 code="unsupported_media_type")
    for content_type in ("application/json; charset=utf-8", "APPLICATION/JSON"):
        assert post(server, None, raw=body, headers={"Content-Type": content_type}).status_code == 200


def _nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


@pytest.mark.parametrize("schema", [
    _nested_schema(450),  # 900 levels, under the JSON decoder's own depth limit: the schema's limit answers
    {"enum": [f"value-{i}" for i in range(100_000)]},
    {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/a"}}},
    {"type": "string", "pattern": "(["},
], ids=["nested_900_levels", "enum_100k", "recursive_ref", "invalid_regex"])
def test_hostile_schemas_are_400s(server, schema):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3,
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}
    error_of(post(server, body, path="/v1/chat/completions"), 400, param="response_format")
    deep = b'{"prompt": "hi", "guided_json": ' + b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"}"
    error_of(post(server, None, raw=deep), 400)
    assert_still_serving(server)


def test_integers_past_64_bits_are_400s(server):
    for field, value in (("seed", 2 ** 64), ("seed", -(2 ** 63) - 1), ("max_tokens", 2 ** 80), ("n", 10 ** 30),
                         ("stop_token_ids", [2 ** 65])):
        error_of(post(server, {"prompt": "hi", field: value}), 400, param=field)
    assert post(server, {"prompt": "hi", "max_tokens": 3, "seed": 2 ** 63 - 1}).status_code == 200
    assert_still_serving(server)
