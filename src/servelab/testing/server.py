"""Helpers for driving a real `servelab serve` subprocess on a free 127.0.0.1 port."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

# A bound on a hang, not a speed target: a server is ready in seconds, but the first start on a clean machine may
# wait for the one-time C++ kernel build (a minute or two on 2 busy cores) and the default model's int8 calibration.
STARTUP_TIMEOUT_S = 300.0
# Tiny engines: one torch thread (the machine is shared), a small fp32 KV pool (fp32 for exact greedy parity).
TINY_ENGINE_FLAGS = ("--dtype", "float32", "--num-threads", "1", "--num-kv-blocks", "512")
API_KEY = "test-key"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def servelab_command() -> list[str]:
    script = Path(sys.executable).with_name("servelab")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "servelab.entrypoints.cli"]


class ServerProcess:
    def __init__(self, model: str | None, flags: tuple[str, ...], log_path: Path, env: dict | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        args = [*servelab_command(), "serve", *([model] if model else []), "--host", "127.0.0.1",
                "--port", str(self.port), *flags]
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(args, stdout=self._log, stderr=subprocess.STDOUT,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = STARTUP_TIMEOUT_S) -> "ServerProcess":
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"server not ready after {timeout} s:\n{self.log()}")

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def request_log_lines(self) -> list[dict]:
        lines = []
        for line in self.log().splitlines():
            _, sep, payload = line.partition("servelab.requests: ")
            if sep:
                lines.append(json.loads(payload))
        return lines

    def signal(self, sig: int) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=30)
        if not self._log.closed:
            self._log.close()


def children(pid: int) -> list[int]:
    """Live (not zombie) child processes of pid, from /proc."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except (FileNotFoundError, ProcessLookupError):
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry))
    return found


def alive(pid: int) -> bool:
    """Running, not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def wait_gone(pids: list[int], timeout: float = 15.0) -> list[int]:
    """The pids still alive after waiting (bounded) for them all to exit."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


def parse_sse(body: str) -> list[str]:
    """Split an SSE body into its data payloads, asserting OpenAI's exact framing."""
    assert body.endswith("\n\n"), body[-200:]
    frames = body[:-2].split("\n\n")
    payloads = []
    for frame in frames:
        assert frame.startswith("data: ") and "\n" not in frame, frame
        payloads.append(frame[len("data: "):])
    return payloads


def metric_values(url: str, headers: dict | None = None) -> dict[str, float]:
    """Prometheus samples as {'name{label=value,...}': value}, labels sorted, model_name left out. A series
    with an `engine` label (one per data-parallel engine core) is there as such and also summed over the
    engines under its name without that label: 'servelab:num_requests_running' is the server's total."""
    from prometheus_client.parser import text_string_to_metric_families

    response = httpx.get(f"{url}/metrics", headers=headers or {}, timeout=10)
    response.raise_for_status()
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = sorted((k, v) for k, v in sample.labels.items() if k != "model_name")
            values[_key(sample.name, labels)] = sample.value
            if "engine" in sample.labels:
                total = _key(sample.name, [(k, v) for k, v in labels if k != "engine"])
                values[total] = values.get(total, 0.0) + sample.value
    return values


def _key(name: str, labels: list[tuple[str, str]]) -> str:
    return f"{name}{{{','.join(f'{k}={v}' for k, v in labels)}}}" if labels else name


def wait_for_metrics(url: str, predicate, timeout: float = 15.0, headers: dict | None = None) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    values = metric_values(url, headers)
    while not predicate(values) and time.monotonic() < deadline:
        time.sleep(0.1)
        values = metric_values(url, headers)
    assert predicate(values), {k: v for k, v in values.items() if "bucket" not in k}
    return values


def flood_with_disconnects(url: str, num_requests: int, seed: int, max_tokens: int,
                           prompt=lambda i: f"Flood {i} goes") -> list[int | None]:
    """num_requests streams at once, each client leaving after 1, 2 or 5 data events or reading to the end
    (seeded); returns when every client is done, with the events each was to read before leaving."""
    import asyncio
    import random

    rng = random.Random(seed)
    leave_after = [rng.choice([1, 2, 5, None]) for _ in range(num_requests)]

    async def one(http: httpx.AsyncClient, i: int) -> None:
        body = {"prompt": prompt(i), "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
        async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200
            seen = 0
            async for line in response.aiter_lines():
                seen += line.startswith("data: ")
                if seen == leave_after[i]:
                    return  # the client goes away mid-stream

    async def flood():
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=num_requests)) as http:
            await asyncio.gather(*(one(http, i) for i in range(num_requests)))

    asyncio.run(flood())
    return leave_after
