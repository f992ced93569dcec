"""`servelab serve` with no flags: --quantization auto picks the default model's measured fastest mode (int8 weights
and KV cache on a machine with servelab's kernels), says so in the banner, on /metrics and in the lab's layout, and
a restart takes the int8 weights from the cache instead of calibrating again."""
from __future__ import annotations

import httpx
import pytest

from servelab.engine_args import EngineArgs
from servelab.model.quant.auto_quantization import resolve_quantization

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(start_server):
    server = start_server(None, "--num-threads", "2")
    yield server
    server.stop()


def test_no_flags_serve_the_mode_auto_picks(server):
    choice = resolve_quantization(EngineArgs())
    log = server.log()
    assert f"precision: --quantization {choice.mode} --kv-cache-dtype {choice.kv_cache_dtype} ({choice.reason})" in log
    metrics = httpx.get(f"{server.url}/metrics", timeout=30).text
    line = next(line for line in metrics.splitlines() if line.startswith("servelab:quantization_info{"))
    assert f'mode="{choice.mode}"' in line and f'kv_cache_dtype="{choice.kv_cache_dtype}"' in line
    assert line.endswith(" 1.0")
    [engine] = httpx.get(f"{server.url}/lab/api/live/layout", timeout=30).json()["engines"]
    assert (engine["quantization"], engine["kv_cache_dtype"], engine["quantization_reason"]) == (
        choice.mode, choice.kv_cache_dtype, choice.reason)
    body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] == 8


def test_a_restart_takes_the_int8_weights_from_the_cache(server, start_server):
    if resolve_quantization(EngineArgs()).quantization != "int8":
        pytest.skip("auto picks no int8 on this machine")
    first = server.log()
    assert "int8 weights from the cache" in first or "int8: calibrated on" in first
    server.stop()
    again = start_server(None, "--num-threads", "2")
    assert "int8 weights from the cache" in again.log()
    assert "int8: calibrated on" not in again.log()
    again.stop()
