"""The all-reduce part of the local-cpu profile: time gloo all-reduces between 2 and 3 processes on this
machine and fit the alpha-beta model the cost model prices tensor parallelism with,
seconds = latency_s + bytes / bytes_per_s."""
from __future__ import annotations

from typing import Callable

import numpy as np

from servelab.executor.efficiency import AllReduceFit

WORLD_SIZES = (2, 3)


def fit_all_reduce(world_size: int, samples: list[tuple[int, float]]) -> AllReduceFit:
    """Least squares of the relative error over (bytes, seconds), so small messages (a decode step's) count
    as much as large ones; a negative intercept (noise) counts as 0."""
    sizes = np.array([s for s, _ in samples], dtype=float)
    seconds = np.array([t for _, t in samples], dtype=float)
    slope, intercept = np.polyfit(sizes, seconds, 1, w=1.0 / seconds)
    if slope <= 0:
        raise ValueError(f"all-reduce times of {world_size} ranks do not grow with the message size: {samples}")
    return AllReduceFit(world_size, max(0.0, float(intercept)), float(1.0 / slope),
                        tuple((int(b), float(t)) for b, t in samples))


def measure_all_reduce(world_sizes: tuple[int, ...] = WORLD_SIZES, repeats: int = 20,
                       progress: Callable[[str], None] = lambda line: None) -> tuple[AllReduceFit, ...]:
    from servelab.distributed.all_reduce_timing import time_all_reduce

    fits = []
    for world_size in world_sizes:
        fit = fit_all_reduce(world_size, time_all_reduce(world_size, repeats))
        progress(f"all-reduce over {world_size} processes (gloo): {fit.latency_s * 1e6:.0f} us + bytes / "
                 f"{fit.bytes_per_s / 1e9:.2f} GB/s")
        fits.append(fit)
    return tuple(fits)
