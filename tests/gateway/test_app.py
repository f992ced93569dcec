"""The ASGI app in process over a real LLMEngine with a stub executor: what clients see when an engine step
fails or the engine is gone (cases a real model cannot be made to produce on demand), and requests the
input processor turns away before they reach the engine."""
import asyncio
import json

import httpx

from servelab.engine.core_client import InprocClient
from servelab.gateway.app import Gateway, build_app
from servelab.gateway.config import ServerConfig
from servelab.testing.stub_engine import make_engine


def run_app(engine, scenario, **config):
    async def main():
        gateway = Gateway([InprocClient(engine)], engine.tokenizer, ServerConfig(served_model_names=("fake",), **config))
        gateway.start()
        try:
            transport = httpx.ASGITransport(app=build_app(gateway))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as http:
                return await asyncio.wait_for(scenario(http, engine, gateway), timeout=30)
        finally:
            await gateway.stop()

    return asyncio.run(main())


def frames(response: httpx.Response) -> list:
    assert response.text.endswith("\n\n")
    return [f.removeprefix("data: ") for f in response.text[:-2].split("\n\n")]


def test_failing_step_gives_error_event_then_the_server_serves_again():
    engine = make_engine()
    engine.executor.fail_next_step = True

    async def scenario(http, engine, gateway):
        streamed = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
        engine.executor.fail_next_step = True
        plain = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        after = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        return streamed, plain, after, engine.is_idle()

    streamed, plain, after, idle = run_app(engine, scenario)
    payloads = frames(streamed)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "server_error" and "boom" in error["message"]
    assert plain.status_code == 500 and "boom" in plain.json()["error"]["message"]
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    assert after.json()["choices"][0]["text"] == " w1 w2 w3"
    assert idle


def test_stopped_engine_is_503_and_unhealthy():
    async def scenario(http, engine, gateway):
        await gateway.engine.shutdown()
        return (await http.post("/v1/completions", json={"prompt": "hi"}), await http.get("/health"))

    response, health = run_app(make_engine(), scenario)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    assert health.status_code == 503 and "shutting down" in health.json()["error"]["message"]


def test_timeout_while_queued_behind_a_long_step():
    engine = make_engine()
    engine.executor.step_delay = 0.5

    async def scenario(http, engine, gateway):
        return await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50})

    response = run_app(engine, scenario, request_timeout=0.2)
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"


def test_input_processor_rejections_are_400s_and_never_reach_the_engine():
    engine = make_engine(num_blocks=8, block_size=4, max_model_len=64)  # a 32-token KV cache

    async def scenario(http, engine, gateway):
        posts = [{"prompt": [2] * 60, "max_tokens": 10}, {"prompt": [2] * 64}, {"prompt": "hi", "max_tokens": 40},
                 {"prompt": [99]}, {"prompt": ""}, {"prompt": [[2] * 10, [2] * 64], "max_tokens": 1}]
        return [await http.post("/v1/completions", json=body) for body in posts]

    responses = run_app(engine, scenario)
    errors = [r.json()["error"] for r in responses]
    assert [r.status_code for r in responses] == [400] * 6
    assert [e["code"] for e in errors] == ["context_length_exceeded"] * 2 + [None] * 3 + ["context_length_exceeded"]
    assert "you requested 70 tokens (60 in the prompt, 10 for max_tokens)" in errors[0]["message"]
    assert "the prompt is 64 tokens" in errors[1]["message"]
    assert "41 tokens of KV cache" in errors[2]["message"] and "holds 32" in errors[2]["message"]
    assert "outside the vocabulary" in errors[3]["message"] and "empty" in errors[4]["message"]
    assert all(e["param"] == "prompt" for e in errors)
    assert engine.thread_ids == set() and engine.executor.num_steps == 0


def test_stop_string_over_http_streams_the_text_before_it():
    async def scenario(http, engine, gateway):
        body = {"prompt": "hi", "max_tokens": 20, "stop": ["w4"], "stream": True}
        return await http.post("/v1/completions", json=body), engine.is_idle()

    response, idle = run_app(make_engine(), scenario)
    chunks = [json.loads(f) for f in frames(response)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == " w1 w2 w3 "
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop" and chunks[-1]["choices"][0]["stop_reason"] == "w4"
    assert idle
