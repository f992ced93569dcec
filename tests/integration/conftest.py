"""Fixtures: a real `servelab serve` subprocess on a free 127.0.0.1 port."""
from __future__ import annotations

from pathlib import Path

import pytest

from server_helpers import ServerProcess


@pytest.fixture(scope="session")
def start_server(tmp_path_factory):
    """start_server(model, *flags, env=None) -> a ready ServerProcess, killed at the end of the session
    (or earlier by the test)."""
    servers: list[ServerProcess] = []

    def start(model: str | Path | None, *flags: str, env: dict | None = None) -> ServerProcess:
        log_path = tmp_path_factory.mktemp("server") / "server.log"
        server = ServerProcess(str(model) if model else None, flags, log_path, env)
        servers.append(server)
        try:
            return server.wait_ready()
        except Exception:
            server.stop()
            raise

    yield start
    for server in servers:
        server.stop()
