import sys
from pathlib import Path

# The gateway tests run a real LLMEngine over the stub executor in tests/engine/stub_engine.py.
sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def start_stub_server(tmp_path_factory):
    """start_stub_server(*flags) -> a ready StubServerProcess, killed when the module's tests end."""
    from stub_process import StubServerProcess

    servers = []

    def start(*flags: str) -> StubServerProcess:
        server = StubServerProcess(flags, tmp_path_factory.mktemp("stub_server") / "server.log")
        servers.append(server)
        return server.wait_ready(timeout=60)

    yield start
    for server in servers:
        server.stop()
