"""A measured curve: seconds as a piecewise-linear function of a count (tokens or rows in a step).

Used where a closed form does not describe the hardware well enough: on a CPU, a step's linear layers
cost neither max(FLOPs, bytes) nor a sum of the two (the GEMV for one row streams weights, a few rows
pay both), so `servelab lab profile` measures the curve at a set of knots and the cost model
interpolates between them, extending the last segment beyond the largest knot.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass


@dataclass(frozen=True)
class PiecewiseLinear:
    xs: tuple[float, ...]  # strictly increasing knots, at least two
    ys: tuple[float, ...]  # value at each knot

    def __post_init__(self) -> None:
        if len(self.xs) < 2 or len(self.xs) != len(self.ys):
            raise ValueError("a piecewise-linear curve needs at least two knots and one value per knot")
        if any(b <= a for a, b in zip(self.xs, self.xs[1:])):
            raise ValueError(f"curve knots must increase strictly, got {self.xs}")

    def __call__(self, x: float) -> float:
        """Interpolated value; 0 for x <= 0 (nothing to do costs nothing); the first and last segments
        extend below the first knot and beyond the last one, never below 0."""
        if x <= 0:
            return 0.0
        xs, ys = self.xs, self.ys
        i = min(max(bisect_right(xs, x), 1), len(xs) - 1)
        x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
        return max(0.0, y0 + (y1 - y0) * (x - x0) / (x1 - x0))

    def to_json(self) -> dict:
        return {"x": list(self.xs), "seconds": list(self.ys)}

    @classmethod
    def from_json(cls, data: dict) -> "PiecewiseLinear":
        return cls(tuple(float(x) for x in data["x"]), tuple(float(y) for y in data["seconds"]))
