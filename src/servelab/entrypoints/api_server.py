"""Run the gateway's app under uvicorn with a draining shutdown.

The first SIGTERM (or Ctrl+C) drains: new requests get 503, in-flight ones finish for up to
--shutdown-grace seconds, then the engine cores are stopped and the process exits 0. A second signal
exits at once. When an engine core dies, the server answers 503 (`engine_dead`) for --shutdown-grace
seconds and then exits 1, so that whatever supervises it restarts it.
"""
from __future__ import annotations

import asyncio
import sys

import prometheus_client
import uvicorn
from fastapi import APIRouter

from servelab.engine.core_client import EngineCoreClient
from servelab.gateway.app import Gateway, build_app
from servelab.gateway.config import ServerConfig
from servelab.entrypoints.http_protocol import header_timeout_protocol
from servelab.model.tokenizer import Tokenizer


def serve(cores: list[EngineCoreClient], tokenizer: Tokenizer, config: ServerConfig, model_path: str | None = None,
          log_level: str = "info", routers: tuple[APIRouter, ...] = ()) -> int:
    """Serve until stopped; the exit status (1 after an engine core died). The cores are stopped on the
    way out (the lifespan does it, and runs on a failed start too)."""
    prometheus_client.disable_created_metrics()  # as vLLM does: no *_created series next to each metric
    gateway = Gateway(cores, tokenizer, config, model_path)
    uv_config = uvicorn.Config(build_app(gateway, routers), host=config.host, port=config.port, log_level=log_level,
                               access_log=False, timeout_graceful_shutdown=5, lifespan="on",
                               http=header_timeout_protocol(config.header_read_timeout))
    server = DrainingServer(uv_config, gateway)
    server.run()
    return server.exit_code


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first exit signal drains instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, gateway: Gateway) -> None:
        super().__init__(config)
        self.gateway = gateway
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task | None = None
        self._watch_task: asyncio.Task | None = None
        self.exit_code = 0

    async def startup(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)
        if self.started:
            self._watch_task = asyncio.ensure_future(self._exit_when_engine_dead())
            print_banner(self.gateway.config, self.bound_port(), self.gateway.engine_info)

    async def _exit_when_engine_dead(self) -> None:
        await self.gateway.wait_engine_dead()
        print("servelab: an engine core died; exiting with status 1", file=sys.stderr, flush=True)
        self.exit_code = 1
        self.should_exit = True

    def bound_port(self) -> int:
        for server in getattr(self, "servers", []):
            for sock in server.sockets:
                return sock.getsockname()[1]
        return self.gateway.config.port

    def handle_exit(self, sig, frame) -> None:
        # Runs in the signal handler: only schedule work on the loop from here.
        if self._drain_task is not None or self._loop is None:
            super().handle_exit(sig, frame)
            return
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        print("servelab: draining (send the signal again to exit now)", file=sys.stderr, flush=True)
        await self.gateway.drain(self.gateway.config.shutdown_grace)
        self.should_exit = True


def print_banner(config: ServerConfig, port: int, info=None) -> None:
    host = config.host if config.host not in ("0.0.0.0", "::") else "127.0.0.1"
    url = f"http://{host}:{port}"
    auth = ' -H "Authorization: Bearer $SERVELAB_API_KEY"' if config.api_keys else ""
    body = ('{"model": "%s", "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 64}'
            % config.model_name)
    print(f"servelab: serving {config.model_name} at {url}/v1 (health {url}/health, metrics {url}/metrics)\n"
          f"  try: curl {url}/v1/chat/completions -H 'Content-Type: application/json'{auth} -d '{body}'",
          flush=True)
    if info is not None:
        print(f"  precision: --quantization {info.quantization} --kv-cache-dtype {info.kv_cache_dtype} "
              f"({info.quantization_reason})", flush=True)
