"""A calibration target's simulated metric, as `lab simulate` computes it, memoised; and how many of its
requests a fit may simulate without moving the metric.

A fit simulates each target hundreds of times, and most of those simulations repeat one already run: a
Jacobian column of a constant the target does not read (a constant shadowed by a more specific scope, another
engine's overhead), a Levenberg-Marquardt retry, the final evaluation. The simulation is a deterministic
function of the target, its request count and the Efficiency it resolves to, so it is cached by those.
"""
from __future__ import annotations

import gc
import math

from servelab.lab.calibrate.targets import Target
from servelab.lab.catalog.calibration import CalibrationProfile
from servelab.lab.sim.api_path import client_timings
from servelab.lab.sim.simulate import DoesNotFit, simulate
from servelab.metrics.request_stats import compute_metrics

# A capped run stands in for the whole workload only if its metric is within this of the whole run's.
CAP_TOLERANCE = 0.01
CACHE_SIZE = 50_000
_CACHE: dict[tuple, float | None] = {}
COLLECT_EVERY = 16
_since_collect = 0


def simulate_target(target: Target, profile: CalibrationProfile, num_prompts: int | None = None) -> float | None:
    """The target's metric (None: the deployment does not fit in memory). num_prompts caps requests arriving
    at a finite rate (a fit's shortcut, see stable_cap); a batch sent all at once keeps its size, whose
    longest outputs decide how long the batch runs."""
    efficiency = profile.efficiency(target.device, target.engine)
    finite = target.workload.request_rate != math.inf
    cap = num_prompts if finite and num_prompts is not None and num_prompts < target.workload.num_prompts else None
    key = (target, cap, efficiency)
    if key not in _CACHE:
        if len(_CACHE) >= CACHE_SIZE:
            _CACHE.clear()
        _CACHE[key] = _simulate(target, efficiency, cap)
    return _CACHE[key]


def _simulate(target: Target, efficiency, cap: int | None) -> float | None:
    deployment = target.build(efficiency)
    try:
        result = simulate(deployment, target.requests(cap))
    except DoesNotFit:
        return None
    timings = client_timings(deployment, result.requests)
    value = compute_metrics(timings, max(t.finished for t in timings), {})[target.metric]
    # a simulation runs with the cyclic collector paused and then moves what it made to the oldest
    # generation (simulate.py), cycles included; a fit runs thousands of them in one process, and without
    # full collections their cycles piled up to 20 GiB. A full collection walks the whole heap, so it runs
    # every COLLECT_EVERY simulations rather than after each.
    del result, timings
    global _since_collect
    _since_collect += 1
    if _since_collect >= COLLECT_EVERY:
        gc.collect()
        _since_collect = 0
    return value


def stable_cap(target: Target, profile: CalibrationProfile, num_prompts: int | None) -> int | None:
    """The fewest requests, num_prompts doubled until it holds, whose metric is within CAP_TOLERANCE of the
    whole workload's at `profile`; None: all of them. A median latency at a steady low load settles within a
    few hundred requests; a throughput under overload, or a queue that keeps building, needs them all."""
    if target.workload.request_rate == math.inf:  # sent all at once: never capped
        return None
    whole = simulate_target(target, profile)
    cap = num_prompts
    while cap is not None and cap < target.workload.num_prompts and whole:
        capped = simulate_target(target, profile, cap)
        if capped and abs(math.log(capped / whole)) <= CAP_TOLERANCE:
            return cap
        cap *= 2
    return None
