"""This machine's roofline, measured: GEMM GFLOP/s (fp32, bf16, int8 dynamic quantization through
fbgemm) on the model's linear-layer shapes, and the read bandwidth of memory that has really been written.

A peer's numbers mean little without these: a decode step at batch 1 reads every weight once (bandwidth
bound), a large batch is bound by GEMM speed.
"""
from __future__ import annotations

import contextlib
import math
import time
import warnings

import torch

DEFAULT_MS = (32, 128, 512)


def linear_shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (in_features, out_features, count per forward) of a Llama-style config.json."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads = config["num_attention_heads"]
    kv_heads = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    layers = config["num_hidden_layers"]
    return {"qkv_proj": (hidden, (heads + 2 * kv_heads) * head_dim, layers),
            "o_proj": (heads * head_dim, hidden, layers),
            "gate_up_proj": (hidden, 2 * inter, layers),
            "down_proj": (inter, hidden, layers),
            "lm_head": (hidden, config["vocab_size"], 1)}


def _time_per_call(fn, min_time_s: float) -> float:
    """Seconds per call: the best of three windows of at least min_time_s / 3 each, after a warm-up call."""
    fn()
    best = math.inf
    for _ in range(3):
        calls, start = 0, time.perf_counter()
        while True:
            fn()
            calls += 1
            elapsed = time.perf_counter() - start
            if elapsed >= min_time_s / 3:
                break
        best = min(best, elapsed / calls)
    return best


def gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype = torch.float32, min_time_s: float = 0.3) -> float:
    """torch.matmul of (m, k) x (k, n): seconds per call."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(m, k, generator=generator).to(dtype)
    b = torch.randn(k, n, generator=generator).to(dtype)
    with torch.inference_mode():
        return _time_per_call(lambda: torch.matmul(a, b), min_time_s)


@contextlib.contextmanager
def _quantized_engine(name: str):
    previous = torch.backends.quantized.engine
    if name in torch.backends.quantized.supported_engines:
        torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = previous


def int8_gemm_seconds(m: int, k: int, n: int, min_time_s: float = 0.3) -> float:
    """A dynamically quantized int8 Linear (k -> n) on an (m, k) fp32 input: seconds per call."""
    with warnings.catch_warnings(), _quantized_engine("fbgemm"):
        warnings.simplefilter("ignore")  # torch deprecates the quantized tensor API in favour of torchao
        torch.manual_seed(0)
        linear = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(torch.nn.Linear(k, n, bias=False)),
                                                        {torch.nn.Linear}, dtype=torch.qint8)
        x = torch.randn(m, k)
        with torch.inference_mode():
            return _time_per_call(lambda: linear(x), min_time_s)


def read_bandwidth_gbs(num_bytes: int = 1 << 30, min_time_s: float = 0.5) -> float:
    """GB/s of summing a float32 buffer that was written first (untouched pages would read as zero pages)."""
    buffer = torch.empty(num_bytes // 4, dtype=torch.float32)
    buffer.fill_(1.0)
    seconds = _time_per_call(lambda: buffer.sum(), min_time_s)
    return buffer.numel() * 4 / seconds / 1e9


def gemm_kinds() -> dict[str, object]:
    """kind -> seconds(m, k, n, min_time_s); bf16 only where the CPU has native bf16 (else it is emulated)."""
    kinds = {"fp32": lambda m, k, n, t: gemm_seconds(m, k, n, torch.float32, t)}
    if getattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)() or \
            getattr(torch.cpu, "_is_amx_tile_supported", lambda: False)():
        kinds["bf16"] = lambda m, k, n, t: gemm_seconds(m, k, n, torch.bfloat16, t)
    kinds["int8"] = lambda m, k, n, t: int8_gemm_seconds(m, k, n, t)
    return kinds


def measure_roofline(shapes: dict[str, tuple[int, int, int]], ms=DEFAULT_MS, min_time_s: float = 0.3,
                     bandwidth_bytes: int = 1 << 30) -> dict:
    """GFLOP/s per (kind, m): per shape, and for one forward's linears (every shape weighted by its count)."""
    gemm = []
    for kind, seconds_of in gemm_kinds().items():
        for m in ms:
            per_shape, total_flops, total_s = {}, 0.0, 0.0
            for name, (k, n, count) in shapes.items():
                seconds = seconds_of(m, k, n, min_time_s)
                flops = 2.0 * m * k * n
                per_shape[name] = flops / seconds / 1e9
                total_flops += count * flops
                total_s += count * seconds
            gemm.append({"kind": kind, "m": m, "gflops": total_flops / total_s / 1e9, "per_shape": per_shape})
    return {"gemm": gemm, "read_bandwidth_gbs": read_bandwidth_gbs(bandwidth_bytes),
            "bandwidth_buffer_bytes": bandwidth_bytes, "torch_threads": torch.get_num_threads()}
