"""Serving metrics from per-request timestamps, with `vllm bench serve`'s definitions and keys.

TTFT: arrival to first token. TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one
output token. ITL: gaps between consecutive tokens. E2E latency: arrival to last token. Queue time:
arrival to first scheduled. Goodput: requests per second that meet every given SLO. Inputs are plain
numbers so the server's Prometheus histograms, the simulator and the load generator all report
through these definitions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np

PERCENTILES = (("median", 50), ("p90", 90), ("p99", 99))


@dataclass(frozen=True)
class RequestTiming:
    prompt_len: int
    output_len: int
    arrival: float
    first_token: float
    finished: float
    # time of every output token, first included (ITL needs them; empty = ITL not reported)
    token_times: Sequence[float] = field(default=())
    first_scheduled: float | None = None

    @property
    def ttft(self) -> float:
        return self.first_token - self.arrival

    @property
    def e2el(self) -> float:
        return self.finished - self.arrival

    @property
    def tpot(self) -> float | None:
        return (self.e2el - self.ttft) / (self.output_len - 1) if self.output_len > 1 else None

    @property
    def queue_time(self) -> float | None:
        return None if self.first_scheduled is None else self.first_scheduled - self.arrival

    @property
    def itls(self) -> list[float]:
        times = self.token_times
        return [b - a for a, b in zip(times, times[1:])]


def _summary(name: str, values_s: np.ndarray, scratch: bool = False) -> dict:
    """scratch: values_s is the caller's to lose (a day's ITLs are scaled and partitioned in place)."""
    ms = np.multiply(values_s, 1000.0, out=values_s if scratch else None)
    out = {f"mean_{name}_ms": float(ms.mean()) if ms.size else 0.0}
    for label, q in PERCENTILES:
        out[f"{label}_{name}_ms"] = float(np.percentile(ms, q, overwrite_input=scratch)) if ms.size else 0.0
    return out


def _inter_token_latencies(token_times: list[Sequence[float]]) -> np.ndarray:
    """Each request's gaps between consecutive tokens, request after request, in one array."""
    lengths = [len(times) for times in token_times]
    gaps = np.empty(sum(n - 1 for n in lengths if n > 1))
    position = 0
    for times, n in zip(token_times, lengths):
        if n > 1:
            t = np.asarray(times, dtype=np.float64)
            np.subtract(t[1:], t[:-1], out=gaps[position:position + n - 1])
            position += n - 1
    return gaps


def meets_slos(timing: RequestTiming, slos_ms: dict[str, float]) -> bool:
    """slos_ms: any of ttft, tpot, e2el in milliseconds (vLLM's --goodput keys)."""
    for key, limit in slos_ms.items():
        value = getattr(timing, key)
        if value is not None and value * 1000.0 > limit:
            return False
    return True


def compute_metrics(timings: Iterable[RequestTiming], duration: float, slos_ms: dict[str, float] | None = None,
                    num_failed: int = 0) -> dict:
    """duration: seconds from the first request sent to the last token received."""
    timings = list(timings)
    duration = duration if duration > 0 else float("nan")
    input_tokens = sum(t.prompt_len for t in timings)
    output_tokens = sum(t.output_len for t in timings)
    ttft = np.array([t.ttft for t in timings])
    tpot = np.array([t.tpot for t in timings if t.tpot is not None])
    e2el = np.array([t.e2el for t in timings])
    itl = _inter_token_latencies([t.token_times for t in timings])
    metrics = {
        "completed": len(timings),
        "failed": num_failed,
        "duration": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(timings) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
    }
    for name, values in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2el", e2el)):
        metrics.update(_summary(name, values, scratch=values is itl))
    if slos_ms:
        good = sum(1 for t in timings if meets_slos(t, slos_ms))
        metrics["request_goodput"] = good / duration
        metrics["slo_attainment"] = good / len(timings) if timings else 0.0
    return metrics
