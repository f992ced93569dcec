"""A `tests/gateway/stub_server.py` process on a free 127.0.0.1 port (the real gateway over the stub engine)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from server_helpers import ServerProcess, free_port

STUB_SERVER = Path(__file__).with_name("stub_server.py")


class StubServerProcess(ServerProcess):
    """A ServerProcess (readiness, log, signals, stop) running the stub server instead of `servelab serve`."""

    def __init__(self, flags: tuple[str, ...], log_path: Path) -> None:  # not the parent's: another command
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        command = [sys.executable, str(STUB_SERVER), "--host", "127.0.0.1", "--port", str(self.port), *flags]
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)
