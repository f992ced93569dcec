"""The ASGI app in process over a scripted engine: what clients see when an engine step fails or the
engine is gone (cases a real model cannot be made to produce on demand)."""
import asyncio
import json

import httpx

from fakes import FakeLLMEngine
from servelab.gateway.app import Gateway, build_app
from servelab.gateway.config import ServerConfig


def run_app(engine, scenario, **config):
    async def main():
        gateway = Gateway(engine, ServerConfig(served_model_names=("fake",), **config))
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
    engine = FakeLLMEngine()
    engine.fail_next_step = True

    async def scenario(http, engine, gateway):
        streamed = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5, "stream": True})
        engine.fail_next_step = True
        plain = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 5})
        after = await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 3})
        return streamed, plain, after

    streamed, plain, after = run_app(engine, scenario)
    payloads = frames(streamed)
    assert payloads[-1] == "[DONE]"
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "server_error" and "boom" in error["message"]
    assert plain.status_code == 500 and "boom" in plain.json()["error"]["message"]
    assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 3
    assert engine.requests == {}


def test_dead_engine_is_503_and_unhealthy():
    async def scenario(http, engine, gateway):
        gateway.engine.shutdown()
        return (await http.post("/v1/completions", json={"prompt": "hi"}), await http.get("/health"))

    response, health = run_app(FakeLLMEngine(), scenario)
    assert response.status_code == 503 and response.json()["error"]["code"] == "engine_dead"
    assert health.status_code == 503


def test_timeout_while_queued_behind_a_long_step():
    engine = FakeLLMEngine()
    engine.step_delay = 0.5

    async def scenario(http, engine, gateway):
        return await http.post("/v1/completions", json={"prompt": "hi", "max_tokens": 50})

    response = run_app(engine, scenario, request_timeout=0.2)
    assert response.status_code == 504 and response.json()["error"]["code"] == "request_timeout"
