"""A server process a benchmark starts, waits for and always stops (servelab serve, llama-server)."""
from __future__ import annotations

import signal
import subprocess


class ServerProcess:
    """Subclasses set self.proc (a Popen) and self._log (its open log file) and define wait_ready()."""

    proc: subprocess.Popen

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
