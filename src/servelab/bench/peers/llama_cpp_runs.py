"""Running llama.cpp's tools for `servelab bench peers`: llama-server (on 127.0.0.1, a free port),
llama-bench (single-stream decode) and llama-quantize (the Q8_0 copy of the default model's GGUF)."""
from __future__ import annotations

import json
import shlex
import socket
import subprocess
import time
from pathlib import Path

from servelab.bench.server_process import ServerProcess
from servelab.bench.peers.llama_cpp_build import LlamaCppTools


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def slot_context(max_request_tokens: int) -> int:
    """Per-slot context: the longest request (prompt + output) rounded up to a power of two, at least 256."""
    size = 256
    while size < max_request_tokens:
        size *= 2
    return size


def server_command(tools: LlamaCppTools, gguf: Path, port: int, num_slots: int, slot_ctx: int,
                   num_threads: int, alias: str) -> list[str]:
    # --cache-ram 0: the host-memory prompt cache would serve a repeated prompt without prefill.
    return [str(tools.path("llama-server")), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port),
            "--alias", alias, "--parallel", str(num_slots), "-c", str(num_slots * slot_ctx), "-fa", "on",
            "-t", str(num_threads), "-tb", str(num_threads), "--cache-ram", "0", "--no-webui"]


class LlamaServer(ServerProcess):
    """llama-server in a subprocess with its log in a file; ready once /health answers 200."""

    def __init__(self, command: list[str], port: int, log_path: Path, startup_timeout_s: float = 300.0) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self.command = command
        self.startup_timeout_s = startup_timeout_s
        self._start(command, log_path)

    def wait_ready(self) -> "LlamaServer":
        import httpx

        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after {self.startup_timeout_s:g} s:\n{self.log_tail()}")


def quantize_command(tools: LlamaCppTools, source: Path, dest: Path, ftype: str, num_threads: int) -> list[str]:
    # The default model's GGUF is already quantized (Q4_1): re-quantizing it needs --allow-requantize.
    return [str(tools.path("llama-quantize")), "--allow-requantize", str(source), str(dest), ftype, str(num_threads)]


def quantized_copy(tools: LlamaCppTools, source: Path, ftype: str, out_dir: Path, num_threads: int) -> Path:
    """source re-quantized to ftype under out_dir, made once (keyed by the source's name, size and mtime)."""
    stat = source.stat()
    dest = out_dir / f"{source.stem}-{stat.st_size}-{stat.st_mtime_ns}.{ftype}.gguf"
    if dest.is_file():
        return dest
    out_dir.mkdir(parents=True, exist_ok=True)
    partial = dest.with_suffix(".partial")
    command = quantize_command(tools, source, partial, ftype, num_threads)
    print("+ " + shlex.join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"llama-quantize failed ({result.returncode}):\n{(result.stdout + result.stderr)[-3000:]}")
    partial.rename(dest)
    return dest


def bench_command(tools: LlamaCppTools, gguf: Path, num_gen: int, num_threads: int, repetitions: int) -> list[str]:
    return [str(tools.path("llama-bench")), "-m", str(gguf), "-p", "0", "-n", str(num_gen), "-t", str(num_threads),
            "-fa", "on", "-r", str(repetitions), "-o", "json"]


def parse_bench_json(text: str) -> dict:
    """llama-bench -o json: one test (tgN) -> its mean and stddev tokens/s and what it ran."""
    tests = json.loads(text)
    if len(tests) != 1:
        raise ValueError(f"expected one llama-bench test, got {len(tests)}")
    test = tests[0]
    return {"tokens_per_s": float(test["avg_ts"]), "stddev_tokens_per_s": float(test["stddev_ts"]),
            "n_gen": int(test["n_gen"]), "n_threads": int(test["n_threads"]), "model_type": test.get("model_type"),
            "build_commit": test.get("build_commit"), "cpu_info": test.get("cpu_info")}


def run_llama_bench(tools: LlamaCppTools, gguf: Path, num_gen: int, num_threads: int, repetitions: int) -> dict:
    command = bench_command(tools, gguf, num_gen, num_threads, repetitions)
    print("+ " + shlex.join(command), flush=True)
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        raise RuntimeError(f"llama-bench failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return {**parse_bench_json(result.stdout), "command": command}
