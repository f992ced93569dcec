"""A request rate that changes over time (`--rate-schedule`), and seeded arrivals that follow it.

    steps:0=2,600=8,1200=2,1800=2   2 req/s from 0 s, 8 from 600 s, 2 from 1200 s; the last point ends it
    ramp:0=1,900=20,1800=1          linear between the points (here up to 20 req/s and back down)
    diurnal:mean=10,peak=18,hours=24  a day's sine: trough at t=0, `peak` req/s at mid-period, period 24 h
    trace:PATH                      replay the arrival times (seconds, one per line) in a file

Arrivals of a rate curve are the workload's gamma-gap process (burstiness 1 = Poisson) on the curve's own
clock: unit-mean gaps accumulate in "expected requests" Lambda(t) = integral of the rate, inverted to seconds.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from servelab.errors import FieldError

KINDS = ("steps", "ramp", "diurnal", "trace")
SECONDS_PER_HOUR = 3600.0
GRID_S = 1.0  # resolution of Lambda's inversion for curves that are not piecewise constant


@dataclass(frozen=True)
class RateSchedule:
    kind: str
    times: tuple[float, ...] = ()  # steps/ramp points; diurnal: (0, duration); trace: the arrival times
    rates: tuple[float, ...] = ()
    mean: float = 0.0
    peak: float = 0.0

    @property
    def duration(self) -> float:
        return self.times[-1] if self.times else 0.0

    def rate_at(self, t: np.ndarray) -> np.ndarray:
        """Requests per second at times t (a trace: its average rate)."""
        t = np.asarray(t, dtype=float)
        if self.kind == "steps":
            index = np.clip(np.searchsorted(self.times, t, side="right") - 1, 0, len(self.rates) - 1)
            return np.asarray(self.rates)[index]
        if self.kind == "ramp":
            return np.interp(t, self.times, self.rates)
        if self.kind == "diurnal":
            amplitude = self.peak - self.mean
            return self.mean - amplitude * np.cos(2 * math.pi * t / (24 * SECONDS_PER_HOUR))
        return np.full_like(t, len(self.times) / max(self.duration, 1e-9))

    def arrival_times(self, burstiness: float, rng: np.random.Generator) -> np.ndarray:
        if self.kind == "trace":
            return np.asarray(self.times, dtype=float)
        grid = self._grid()
        rates = self.rate_at(grid)
        if self.kind == "steps":  # exact: the rate is constant on each cell, taken at its start
            cells = rates[:-1] * np.diff(grid)
        else:
            cells = (rates[:-1] + rates[1:]) / 2 * np.diff(grid)
        expected = np.concatenate([[0.0], np.cumsum(cells)])
        total = expected[-1]
        units = []
        have = 0.0
        while have < total:  # unit-mean gamma gaps, as sample_arrival_times draws them at rate 1
            gaps = rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=max(64, int((total - have) * 1.1) + 64))
            sums = have + np.cumsum(gaps)
            units.append(sums)
            have = float(sums[-1])
        marks = np.concatenate(units)
        marks = marks[marks < total]
        index = np.searchsorted(expected, marks, side="left").clip(1, len(grid) - 1)
        low, high = expected[index - 1], expected[index]
        return grid[index - 1] + (marks - low) / (high - low) * (grid[index] - grid[index - 1])

    def _grid(self) -> np.ndarray:
        if self.kind == "steps":
            return np.asarray(self.times, dtype=float)
        cells = max(1, int(math.ceil(self.duration / GRID_S)))
        grid = np.linspace(0.0, self.duration, cells + 1)
        return np.union1d(grid, self.times) if self.kind == "ramp" else grid

    def describe(self) -> str:
        if self.kind == "trace":
            return f"a trace of {len(self.times)} arrivals over {self.duration:,.0f} s"
        if self.kind == "diurnal":
            return f"a diurnal curve averaging {self.mean:g} req/s (peak {self.peak:g}) over {self.duration / 3600:g} h"
        points = ", ".join(f"{r:g}@{t:g}s" for t, r in zip(self.times, self.rates))
        return f"a {self.kind} schedule ({points})"


def parse_rate_schedule(text: str) -> RateSchedule:
    """`kind:spec` -> RateSchedule; a trace's file is read here. Errors name the field `rate_schedule`."""
    kind, _, spec = text.partition(":")
    kind = kind.strip()
    if kind not in KINDS or not spec.strip():
        raise FieldError(f"{{rate_schedule}} must be one of {', '.join(k + ':...' for k in KINDS)}, got {text!r}",
                         "rate_schedule")
    try:
        if kind == "trace":
            return _trace(Path(spec.strip()))
        if kind == "diurnal":
            return _diurnal(spec)
        return _points(kind, spec)
    except (ValueError, OSError) as err:
        if isinstance(err, FieldError):
            raise
        raise FieldError(f"{{rate_schedule}} {text!r}: {err}", "rate_schedule") from None


def _points(kind: str, spec: str) -> RateSchedule:
    pairs = [item.split("=") for item in spec.split(",")]
    if any(len(p) != 2 for p in pairs):
        raise ValueError("expected points TIME=RATE separated by commas")
    times = tuple(float(t) for t, _ in pairs)
    rates = tuple(float(r) for _, r in pairs)
    if len(times) < 2 or times[0] != 0 or any(b <= a for a, b in zip(times, times[1:])):
        raise ValueError("expected at least two points with increasing times, the first at 0")
    if any(r < 0 or not math.isfinite(r) for r in rates) or max(rates[:-1] if kind == "steps" else rates) <= 0:
        raise ValueError("rates must be finite, >= 0, and not all 0")
    return RateSchedule(kind, times, rates)


def _diurnal(spec: str) -> RateSchedule:
    values = dict(item.split("=", 1) for item in spec.split(","))
    unknown = set(values) - {"mean", "peak", "hours"}
    if unknown:
        raise ValueError(f"unknown keys {', '.join(sorted(unknown))} (mean, peak, hours)")
    mean = float(values["mean"])
    peak = float(values.get("peak", 2 * mean))
    hours = float(values.get("hours", 24))
    if not (mean > 0 and mean <= peak <= 2 * mean and hours > 0):
        raise ValueError("needs mean > 0, mean <= peak <= 2 * mean (the trough is 2 * mean - peak) and hours > 0")
    return RateSchedule("diurnal", (0.0, hours * SECONDS_PER_HOUR), mean=mean, peak=peak)


def _trace(path: Path) -> RateSchedule:
    times = np.sort(np.loadtxt(path, dtype=float, ndmin=1))
    if times.size == 0 or not np.all(np.isfinite(times)):
        raise ValueError(f"{path} holds no arrival times")
    times -= times[0]
    return RateSchedule("trace", tuple(times.tolist()))
