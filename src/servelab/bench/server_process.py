"""A server process a benchmark starts, waits for and always stops (servelab serve, llama-server)."""
from __future__ import annotations

import signal
import subprocess
from pathlib import Path


class ServerProcess:
    """Subclasses call _start() and define wait_ready()."""

    proc: subprocess.Popen
    log_path: Path

    def _start(self, command: list[str], log_path: Path) -> None:
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(command, stdout=self._log, stderr=subprocess.STDOUT)

    def log_tail(self, num_chars: int = 3000) -> str:
        self._log.flush()
        return self.log_path.read_text(errors="replace")[-num_chars:]

    def wait_ready(self):
        raise NotImplementedError

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=timeout_s)
        self._log.close()

    def __enter__(self):
        try:
            return self.wait_ready()
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()
