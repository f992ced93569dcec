"""Text and PNG reports of `bench serve | sweep | stages` results (matplotlib's Agg backend, no display).

Everything here reads the result dicts `bench serve` writes (vLLM's summary keys plus the per-request
lists start_times, ttfts, itls, e2els, output_lens, errors), so a saved JSON can be plotted again.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

METRIC_NAMES = (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency"))
STAT_LABELS = (("mean", "Mean"), ("median", "Median"), ("p90", "P90"), ("p99", "P99"))


def request_tpots(result: dict) -> list[float]:
    return [(e2el - ttft) / (out - 1) for e2el, ttft, out, err in
            zip(result["e2els"], result["ttfts"], result["output_lens"], result["errors"]) if not err and out > 1]


def request_ttfts(result: dict) -> list[float]:
    return [ttft for ttft, err in zip(result["ttfts"], result["errors"]) if not err]


def tokens_per_second(result: dict, bucket_s: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """Output tokens received per bucket (seconds since the start, tokens/s). A chunk carries its
    request's output tokens divided evenly over its chunks (one each when the server streams per token)."""
    times, weights = [], []
    for start, ttft, itls, out, err in zip(result["start_times"], result["ttfts"], result["itls"],
                                           result["output_lens"], result["errors"]):
        if err or out <= 0:
            continue
        chunk_times = start + ttft + np.concatenate([[0.0], np.cumsum(itls)])
        times.append(chunk_times)
        weights.append(np.full(chunk_times.size, out / chunk_times.size))
    if not times:
        return np.empty(0), np.empty(0)
    t, w = np.concatenate(times), np.concatenate(weights)
    buckets = np.floor(t / bucket_s).astype(np.int64)
    counts = np.bincount(buckets, weights=w)
    return np.arange(counts.size) * bucket_s, counts / bucket_s


def _num(value) -> str:
    return "-" if value is None else f"{value:,.2f}" if isinstance(value, float) else str(value)


def _overview(result: dict) -> list[tuple[str, object]]:
    lines = [("Successful requests", result["completed"]), ("Failed requests", result["failed"]),
             ("Maximum request concurrency", result.get("max_concurrency")),
             ("Benchmark duration (s)", result["duration"]), ("Total input tokens", result["total_input_tokens"]),
             ("Total generated tokens", result["total_output_tokens"]),
             ("Request throughput (req/s)", result["request_throughput"])]
    if "request_goodput" in result:
        lines += [("Request goodput (req/s)", result["request_goodput"]),
                  ("Requests meeting every SLO (share)", result["goodput_share"])]
    return lines + [("Output token throughput (tok/s)", result["output_throughput"]),
                    ("Peak output token throughput (tok/s)", result["max_output_tokens_per_s"]),
                    ("Peak concurrent requests", result["max_concurrent_requests"]),
                    ("Total token throughput (tok/s)", result["total_token_throughput"])]


def _latency(result: dict, key: str) -> list[tuple[str, object]]:
    return [(f"{label} {key.upper()} (ms)", result[f"{stat}_{key}_ms"]) for stat, label in STAT_LABELS]


def summary_rows(result: dict) -> list[dict]:
    lines = _overview(result) + [line for key, _ in METRIC_NAMES for line in _latency(result, key)]
    return [{"metric": name, "value": _num(value)} for name, value in lines]


def format_summary(result: dict) -> str:
    """vllm bench serve's printed summary, plus one line per distinct error."""
    out = ["{:=^50}".format(" Serving Benchmark Result ")]
    out += [f"{name + ':':<40} {_num(value):>9}" for name, value in _overview(result)]
    for key, title in METRIC_NAMES:
        out.append("{:-^50}".format(title))
        out += [f"{name + ':':<40} {_num(value):>9}" for name, value in _latency(result, key)]
    out += [f"error x{count}: {message}" for message, count in result.get("error_counts", {}).items()]
    out.append("=" * 50)
    return "\n".join(out)


def _figure(width: float = 6.4, height: float = 4.0, ncols: int = 1):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, ncols, figsize=(width, height))
    return plt, fig, axes


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_cdfs(series: dict[str, list[float]], xlabel: str, title: str, path: Path) -> Path:
    """One empirical CDF per label; values in seconds, drawn in milliseconds."""
    plt, fig, ax = _figure()
    for label, values in series.items():
        if values:
            ms = np.sort(np.asarray(values)) * 1000.0
            ax.step(ms, np.arange(1, ms.size + 1) / ms.size, where="post", label=label)
    ax.set_xlabel(xlabel)
    ax.set_ylabel("share of requests")
    ax.set_ylim(0, 1.02)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_throughput_over_time(series: dict[str, tuple[np.ndarray, np.ndarray]], title: str, path: Path) -> Path:
    plt, fig, ax = _figure()
    for label, (t, rate) in series.items():
        if t.size:  # each value holds from its bucket's start to the next one's
            ax.stairs(rate, np.append(t, t[-1] + (t[1] - t[0] if t.size > 1 else 1.0)), label=label)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("output tokens/s")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    if len(series) > 1:
        ax.legend(fontsize=8)
    return _save(plt, fig, path)


def plot_serve(result: dict, out_dir: Path) -> list[Path]:
    title = f"{result.get('model_id', '')} at {result.get('request_rate', '')} req/s, {result['completed']} requests"
    return [plot_cdfs({"TTFT": request_ttfts(result)}, "TTFT (ms)", title, out_dir / "ttft_cdf.png"),
            plot_cdfs({"TPOT": request_tpots(result)}, "TPOT (ms)", title, out_dir / "tpot_cdf.png"),
            plot_throughput_over_time({"output": tokens_per_second(result)}, title, out_dir / "tokens_per_s.png")]


def plot_against(points: list[dict], x: str, xlabel: str, title: str, path: Path) -> Path:
    """Latency (median and p99 TTFT and TPOT) and output tokens/s against x (a request rate, a stage index)."""
    plt, fig, (lat, thr) = _figure(11.0, 4.0, ncols=2)
    xs = [p[x] for p in points]
    for key, style in (("median_ttft_ms", "o-"), ("p99_ttft_ms", "o--"), ("median_tpot_ms", "s-"),
                       ("p99_tpot_ms", "s--")):
        lat.plot(xs, [p[key] for p in points], style, label=key)
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    thr.plot(xs, [p["output_throughput"] for p in points], "o-", label="output tokens/s")
    thr.set_ylabel("output tokens/s")
    for ax in (lat, thr):
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    return _save(plt, fig, path)


def plot_stages(runs: list[dict], out_dir: Path, title: str) -> list[Path]:
    """stages.png: output tokens/s and p50/p99 TTFT and TPOT per stage; then the stages' TTFT and TPOT
    CDFs and tokens/s over time overlaid (runs without per-request lists, like the HF baseline, are bars only)."""
    plt, fig, (thr, ttft, tpot) = _figure(13.0, 4.2, ncols=3)
    labels = [r["stage"] for r in runs]
    x = np.arange(len(runs))
    thr.bar(x, [r["output_throughput"] for r in runs], color="tab:green")
    thr.set_ylabel("output tokens/s")
    for ax, key in ((ttft, "ttft"), (tpot, "tpot")):
        timed = [r for r in runs if f"p99_{key}_ms" in r]
        tx = np.arange(len(timed))
        ax.bar(tx - 0.2, [r[f"median_{key}_ms"] for r in timed], 0.4, label="p50")
        ax.bar(tx + 0.2, [r[f"p99_{key}_ms"] for r in timed], 0.4, label="p99")
        ax.set_ylabel(f"{key.upper()} ms")
        ax.set_xticks(tx, [r["stage"] for r in timed], rotation=15, ha="right", fontsize=7)
        ax.legend(fontsize=8)
    thr.set_xticks(x, labels, rotation=15, ha="right", fontsize=7)
    for ax in (thr, ttft, tpot):
        ax.grid(True, axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=9)
    paths = [_save(plt, fig, out_dir / "stages.png")]
    timed = [r for r in runs if "ttfts" in r]
    paths.append(plot_cdfs({r["stage"]: request_ttfts(r) for r in timed}, "TTFT (ms)", title, out_dir / "ttft_cdf.png"))
    paths.append(plot_cdfs({r["stage"]: request_tpots(r) for r in timed}, "TPOT (ms)", title, out_dir / "tpot_cdf.png"))
    paths.append(plot_throughput_over_time({r["stage"]: tokens_per_second(r) for r in timed}, title,
                                           out_dir / "tokens_per_s.png"))
    return paths
