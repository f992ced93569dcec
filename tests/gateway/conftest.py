# The gateway tests run a real LLMEngine over servelab.testing's stub executor.
import pytest


@pytest.fixture(scope="module")
def start_stub_server(tmp_path_factory):
    """start_stub_server(*flags) -> a ready StubServerProcess, killed when the module's tests end."""
    from servelab.testing.stub_server import StubServerProcess

    servers = []

    def start(*flags: str) -> StubServerProcess:
        server = StubServerProcess(flags, tmp_path_factory.mktemp("stub_server") / "server.log")
        servers.append(server)
        return server.wait_ready(timeout=60)

    yield start
    for server in servers:
        server.stop()
