"""Serving metrics from per-request timestamps, with `vllm bench serve`'s definitions and keys.

TTFT: arrival to first token. TPOT: (E2E - TTFT) / (output tokens - 1), for requests with more than one
output token. ITL: gaps between consecutive tokens. E2E latency: arrival to last token. Queue time:
arrival to first scheduled. Goodput: requests per second that meet every given SLO. Inputs are plain
numbers so the server's Prometheus histograms, the simulator and the load generator all report
through these definitions.
"""
from __future__ import annotations

import itertools
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


def _summary(name: str, values_s: np.ndarray) -> dict:
    ms = values_s * 1000.0
    out = {f"mean_{name}_ms": float(ms.mean()) if ms.size else 0.0}
    for label, q in PERCENTILES:
        out[f"{label}_{name}_ms"] = float(np.percentile(ms, q)) if ms.size else 0.0
    return out


def _inter_token_latencies(token_times: list[Sequence[float]]) -> np.ndarray:
    lengths = np.array([len(times) for times in token_times], dtype=np.int64)
    if lengths.sum() == 0:
        return np.empty(0)
    flat = np.fromiter(itertools.chain.from_iterable(token_times), dtype=np.float64, count=int(lengths.sum()))
    gaps = np.diff(flat)
    # drop the gaps between one request's last token and the next request's first
    ends = np.cumsum(lengths)[:-1] - 1
    keep = np.ones(gaps.size, dtype=bool)
    keep[ends[(ends >= 0) & (ends < gaps.size)]] = False
    return gaps[keep]


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
        metrics.update(_summary(name, values))
    if slos_ms:
        good = sum(1 for t in timings if meets_slos(t, slos_ms))
        metrics["request_goodput"] = good / duration
        metrics["slo_attainment"] = good / len(timings) if timings else 0.0
    return metrics
