"""What the server defends itself against: API keys compared in constant time and never echoed or logged,
read-only routes refusing other methods, a static route that cannot be walked out of (.., encodings,
symlinks), CORS off unless --allowed-origins, and a default bind of 127.0.0.1."""
from __future__ import annotations

import argparse
import asyncio
import hmac

import httpx
import pytest

from servelab.engine.core_client import InprocClient
from servelab.entrypoints.serve import add_serve_parser, server_config
from servelab.gateway import auth as auth_module
from servelab.gateway.app import Gateway, build_app
from servelab.gateway.auth import ApiKeyAuth
from servelab.gateway.config import ServerConfig
from servelab.lab.web import routes as lab_routes
from servelab.testing.stub_engine import make_engine

SECRET = "sk-servelab-SECRET-0123456789"


def run_app(scenario, routers=(), **config):
    async def main():
        engine = make_engine()
        gateway = Gateway([InprocClient(engine)], engine.tokenizer, ServerConfig(**config))
        gateway.start()
        try:
            transport = httpx.ASGITransport(app=build_app(gateway, routers))
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=20) as http:
                return await asyncio.wait_for(scenario(http), timeout=30)
        finally:
            await gateway.stop()

    return asyncio.run(main())


def serve_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_api_keys_are_compared_in_constant_time_against_every_key(monkeypatch):
    calls = []
    compare_digest = hmac.compare_digest

    def recording(a, b):
        calls.append((a, b))
        return compare_digest(a, b)

    monkeypatch.setattr(auth_module.hmac, "compare_digest", recording)
    auth = ApiKeyAuth(("key-one", "key-two", "key-three"))
    for header, ok in (("Bearer key-one", True), ("Bearer key-three", True), ("Bearer key-on", False),
                       ("Bearer " + "x" * 500, False), ("Basic key-one", False), (None, False), ("Bearer ", False)):
        calls.clear()
        assert auth.check(header) is ok, header
        assert len(calls) == 3, header  # no early exit on a match, no shortcut on the length


def test_api_keys_never_appear_in_error_bodies_or_logs(start_stub_server):
    server = start_stub_server("--api-key", SECRET, "--protect-metrics", "--log-level", "debug")
    wrong = SECRET[:-1]
    seen = []
    with httpx.Client(timeout=30) as http:
        for headers in ({}, {"Authorization": f"Bearer {wrong}"}, {"Authorization": SECRET},
                        {"Authorization": f"Basic {SECRET}"}, {"Authorization": f"Bearer {SECRET}"}):
            for method, path, body in (("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2}),
                                       ("POST", "/v1/chat/completions", {"messages": "not a list"}),
                                       ("GET", "/v1/models", None), ("GET", "/metrics", None),
                                       ("POST", "/v1/completions", {"prompt": "hi", "max_tokens": -1})):
                response = http.request(method, f"{server.url}{path}", json=body, headers=headers)
                seen.append((headers, path, response.status_code))
                assert SECRET not in response.text and wrong not in response.text
                assert not any(SECRET in v or wrong in v for v in response.headers.values())
    assert ({}, "/v1/models", 401) in seen and ({"Authorization": f"Bearer {SECRET}"}, "/v1/models", 200) in seen
    log = server.log()
    assert "servelab.requests" in log  # the request log is on, at debug level
    assert SECRET not in log and wrong not in log


@pytest.mark.parametrize("path", ["/metrics", "/health", "/v1/models", "/v1/metrics/stream", "/lab",
                                  "/lab/api/catalog", "/lab/api/status", "/lab/static/lab.js"])
def test_read_only_routes_refuse_every_other_method(path):
    async def scenario(http):
        return {m: await http.request(m, path) for m in ("POST", "PUT", "PATCH", "DELETE")}

    for method, response in run_app(scenario, routers=(lab_routes.build_lab_router(),)).items():
        assert response.status_code == 405, (method, path, response.text)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_static_route_cannot_escape_its_folder(tmp_path, monkeypatch):
    static = tmp_path / "static"
    static.mkdir()
    (static / "lab.css").write_text("body {}")
    (tmp_path / "secret.txt").write_text("TOP-SECRET")
    (static / "lab.js").symlink_to(tmp_path / "secret.txt")  # a listed name linking out of the folder
    (static / "i18n.js").symlink_to(static / "lab.css")  # a link that stays inside is fine
    monkeypatch.setattr(lab_routes, "STATIC_DIR", static)

    async def scenario(http):
        paths = ["/lab/static/lab.js", "/lab/static/../secret.txt", "/lab/static/%2e%2e/secret.txt",
                 "/lab/static/..%2fsecret.txt", "/lab/static/%2e%2e%2fsecret.txt", "/lab/static/%252e%252e/secret.txt",
                 "/lab/static/..%5csecret.txt", "/lab/static/" + str(tmp_path / "secret.txt"),
                 "/lab/static/lab.css", "/lab/static/i18n.js"]
        return {p: await http.get(p) for p in paths}

    responses = run_app(scenario, routers=(lab_routes.build_lab_router(),))
    for path, response in responses.items():
        assert "TOP-SECRET" not in response.text, path
        if path.endswith(("lab.css", "i18n.js")):
            assert response.status_code == 200 and response.text == "body {}", path
        else:
            assert response.status_code == 404, (path, response.status_code)


def test_cors_is_off_unless_origins_are_given():
    preflight = {"Origin": "https://evil.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}

    async def scenario(http):
        return (await http.options("/v1/completions", headers=preflight),
                await http.get("/v1/models", headers={"Origin": "https://evil.example"}),
                await http.options("/v1/completions", headers={**preflight, "Origin": "https://app.example"}),
                await http.get("/v1/models", headers={"Origin": "https://app.example"}))

    for response in run_app(scenario):
        assert not any(h.startswith("access-control-") for h in response.headers), response.headers
    evil_pre, evil_get, app_pre, app_get = run_app(scenario, allowed_origins=("https://app.example",))
    assert "access-control-allow-origin" not in evil_pre.headers and "access-control-allow-origin" not in evil_get.headers
    assert app_pre.status_code == 200 and app_pre.headers["access-control-allow-origin"] == "https://app.example"
    assert "POST" in app_pre.headers["access-control-allow-methods"]
    assert app_get.status_code == 200 and app_get.headers["access-control-allow-origin"] == "https://app.example"
    config = server_config(serve_args("--allowed-origins", "https://app.example", "https://b.example"), None)
    assert config.allowed_origins == ("https://app.example", "https://b.example")
    assert server_config(serve_args(), None).allowed_origins == ()


def test_default_bind_is_loopback():
    assert serve_args().host == "127.0.0.1"
    assert server_config(serve_args(), None).host == ServerConfig().host == "127.0.0.1"
