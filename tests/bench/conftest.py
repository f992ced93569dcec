"""Fixtures for the load-generator tests: a real `servelab serve` (tests/integration's helpers) and the
default model's tokenizer."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from server_helpers import ServerProcess  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    from servelab.bench.datasets import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def start_server(tmp_path_factory):
    """start_server(model, *flags) -> a ready ServerProcess, killed when the module's tests are done."""
    servers: list[ServerProcess] = []

    def start(model, *flags: str) -> ServerProcess:
        server = ServerProcess(str(model), flags, tmp_path_factory.mktemp("server") / "server.log")
        servers.append(server)
        try:
            return server.wait_ready()
        except Exception:
            server.stop()
            raise

    yield start
    for server in servers:
        server.stop()
