"""What serving adds to a step on this machine, for the `local-cpu` profile.

The step grid times the executor alone. Served, each step also pays for the engine's bookkeeping,
detokenization, one SSE event per streaming request, and the client reading them; on a CPU those
share the cores with the model's threads and slow its steps down. This starts `servelab serve` with
the profiled flags, streams c requests at once for a few c (the load generator, as `lab validate`
and `bench stages` run it), and compares each run's median TPOT with the fitted decode step of c
requests. The differences, as a piecewise-linear curve over c, become the cost model's overhead
(not a straight line: per stream it costs most at a few streams, ~3 ms at 4, ~1.4 ms at 32 here).
The server first serves the largest concurrency once unmeasured (its first steps of each shape pay for
allocations), then every concurrency ROUNDS times in turn, keeping the median of its runs' median TPOTs, as
the step grid keeps each shape's median step: one run each, measured first on a cold server, scattered the
overhead at 1-2 streams between 3 and 50 ms from profile to profile. The median, not the fastest: served
steps run at the machine's typical speed, and `lab validate` compares with the median of real runs.

A new request costs something more before its first step: HTTP parsing, tokenization and admission, on
the same cores. A few lone requests, one after another, measure it: their median TTFT less the fitted
prefill step and the one-stream overhead is the arrival overhead.
"""
from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Callable

from servelab.engine_args import EngineArgs
from servelab.executor.curve import PiecewiseLinear
from servelab.executor.cost_model import CostModel, plan_totals
from servelab.lab.calibrate.fit import StepShape, shape_plan

CONCURRENCIES = (1, 2, 3, 4, 8, 16, 32)
ROUNDS = 3
PROMPT_LEN, OUTPUT_LEN = 32, 48
NUM_LONE_REQUESTS = 7


def server_flags(args: EngineArgs) -> list[str]:
    """`servelab serve` flags that build the same engine as args (the model is passed separately)."""
    flags = []
    for name in ("dtype", "schedule", "max_num_seqs", "max_num_batched_tokens", "max_model_len", "kv_cache_memory",
                 "block_size", "num_kv_blocks", "num_threads", "quantization", "kv_cache_dtype"):
        value = getattr(args, name)
        if value is not None:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return flags + ["--request-timeout", "0", "--log-level", "warning"]


def measure_serving_overhead(args: EngineArgs, steps: CostModel, concurrencies: tuple[int, ...] = CONCURRENCIES,
                             rounds: int = ROUNDS,
                             progress: Callable[[str], None] | None = None,
                             startup_timeout_s: float = 600.0) -> dict:
    """{"curve": PiecewiseLinear over concurrency, "points": [{concurrency, tpot_ms, predicted_step_ms}],
    "arrival_s": seconds, "arrival": {ttft_ms, predicted_prefill_ms}}. steps: the fitted cost model of the
    executor's steps alone (fit.fitted_cost_model)."""
    import asyncio

    from servelab.bench.datasets import build_requests, load_tokenizer
    from servelab.bench.loadgen import ClientConfig, first_model_id
    from servelab.bench.serve import run_benchmark
    from servelab.bench.stages import ServelabServer
    from servelab.workload import WorkloadConfig

    concurrencies = tuple(c for c in concurrencies if c <= args.max_num_seqs)
    tokenizer = load_tokenizer(args.model)
    points = []
    with tempfile.TemporaryDirectory(prefix="servelab-profile-") as log_dir, \
            ServelabServer(args.model, server_flags(args), Path(log_dir) / "serve.log", startup_timeout_s) as server:
        client = ClientConfig(base_url=server.url, endpoint="/v1/completions",
                              model=asyncio.run(first_model_id(server.url)), ignore_eos=True)

        def run(workload: WorkloadConfig, max_concurrency: int | None = None) -> dict:
            result = run_benchmark(client, build_requests(workload, tokenizer), tokenizer, max_concurrency,
                                   show_progress=False)
            if result["failed"]:
                raise RuntimeError(f"{result['failed']} profiling requests failed: {result.get('error_counts')}")
            return result

        def streams(c: int) -> WorkloadConfig:
            return WorkloadConfig(num_prompts=c, input_len=PROMPT_LEN, output_len=OUTPUT_LEN, seed=c)

        if concurrencies:
            run(streams(max(concurrencies)))  # warm-up, not measured
        tpots: dict[int, list[float]] = {c: [] for c in concurrencies}
        for _ in range(rounds):
            for c in concurrencies:
                tpots[c].append(run(streams(c))["median_tpot_ms"])
        for c in concurrencies:
            # the decode steps of c requests at the run's middle context length
            middle = PROMPT_LEN + OUTPUT_LEN // 2
            predicted = _step_seconds(steps, [(middle, 1, True)] * c)
            points.append({"concurrency": c, "tpot_ms": statistics.median(tpots[c]), "tpot_ms_rounds": tpots[c],
                           "predicted_step_ms": predicted * 1e3})
            if progress:
                progress(f"serving {c} streams: TPOT {statistics.median(tpots[c]):.1f} ms (median of {rounds}), "
                         f"the executor's step alone {predicted * 1e3:.1f} ms")
        # a few tokens: the first ones can decode to no text yet, and the load generator needs text
        lone = run(WorkloadConfig(num_prompts=NUM_LONE_REQUESTS, input_len=PROMPT_LEN, output_len=8, seed=0),
                   max_concurrency=1)
    xs = tuple(p["concurrency"] for p in points)
    ys = tuple(max(0.0, p["tpot_ms"] - p["predicted_step_ms"]) / 1e3 for p in points)
    if len(points) == 1:  # a profile of --max-num-seqs 1..3: a flat overhead
        xs, ys = (xs[0], xs[0] + 1), (ys[0], ys[0])
    curve = PiecewiseLinear(xs, ys)
    prefill = _step_seconds(steps, [(0, PROMPT_LEN, True)]) + curve(1)
    ttft_ms = lone["median_ttft_ms"]
    arrival_s = max(0.0, ttft_ms / 1e3 - prefill)
    if progress:
        progress(f"lone requests: TTFT {ttft_ms:.1f} ms, their prefill step {prefill * 1e3:.1f} ms: "
                 f"arrival overhead {arrival_s * 1e3:.1f} ms")
    return {"curve": curve, "points": points, "prompt_len": PROMPT_LEN, "output_len": OUTPUT_LEN, "arrival_s": arrival_s,
            "arrival": {"ttft_ms": ttft_ms, "predicted_prefill_ms": prefill * 1e3}}


def _step_seconds(steps: CostModel, shape: StepShape) -> float:
    return steps.price(plan_totals(shape_plan(shape)))["total"]
