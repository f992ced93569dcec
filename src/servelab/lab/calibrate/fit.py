"""Fitting the lab's step-cost model to step times measured on the real engine (`servelab lab profile`).

A timed step is reduced to the quantities the CostModelExecutor prices a StepPlan by: tokens,
sampled rows, requests, attention (query, key) pairs and KV entries touched. The model fitted is the
cost model's own shape for a measured device:

    seconds = request_overhead * requests + layers(tokens) + lm_head(sampled)
              + max(pair_cost * pairs, kv_cost * kv_tokens)

with layers() and lm_head() non-decreasing piecewise-linear curves (values at knots) and every
constant >= 0. The
max() is fitted by alternating: assign each step to the side of max() the current constants pick
(first: decode steps to the KV side, prefill to the pairs side),
solve a non-negative least-squares problem on relative error, repeat until the assignment settles.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from servelab.executor.curve import PiecewiseLinear

# (num_computed_tokens, num_new_tokens, sample) of each request in a step, as a StepPlan holds them.
StepShape = list[tuple[int, int, bool]]
TOKEN_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ALTERNATIONS = 8


@dataclass(frozen=True)
class StepSample:
    tokens: int
    sampled: int
    requests: int
    pairs: int
    kv_tokens: int
    seconds: float


def step_sample(shape: StepShape, seconds: float) -> StepSample:
    """The totals CostModelExecutor._plan_totals computes for the same plan."""
    tokens = sampled = pairs = kv_tokens = 0
    for computed, n, sample in shape:
        context = computed + n
        tokens += n
        pairs += n * context - n * (n - 1) // 2
        kv_tokens += context + n
        sampled += bool(sample)
    return StepSample(tokens, sampled, len(shape), pairs, kv_tokens, seconds)


@dataclass(frozen=True)
class StepFit:
    layers: PiecewiseLinear
    lm_head: PiecewiseLinear
    request_overhead_s: float
    pair_cost_s: float  # seconds per (query, key) pair, all layers
    kv_cost_s: float  # seconds per KV entry read or written, all layers
    mean_abs_rel_error: float
    max_abs_rel_error: float

    def predict(self, s: StepSample) -> float:
        return (self.request_overhead_s * s.requests + self.layers(s.tokens)
                + (self.lm_head(s.sampled) if s.sampled else 0.0)
                + max(self.pair_cost_s * s.pairs, self.kv_cost_s * s.kv_tokens))


def knots_for(values: list[int]) -> tuple[int, ...]:
    """TOKEN_KNOTS up to the first one at or past the largest value measured (at least two)."""
    top = max(values)
    knots = [k for k in TOKEN_KNOTS if k < top]
    knots.append(next((k for k in TOKEN_KNOTS if k >= top), top))
    return tuple(knots) if len(knots) >= 2 else (1, 2)


def hat_weights(x: float, knots: tuple[int, ...]) -> np.ndarray:
    """Weights w with sum(w * values) = the piecewise-linear interpolation at x (extrapolating the
    end segments), so curve values at the knots are linear least-squares unknowns."""
    w = np.zeros(len(knots))
    if x <= 0:
        return w
    i = min(max(int(np.searchsorted(knots, x, side="right")), 1), len(knots) - 1)
    u = (x - knots[i - 1]) / (knots[i] - knots[i - 1])
    w[i - 1], w[i] = 1 - u, u
    return w


def increments(weights: np.ndarray) -> np.ndarray:
    """Hat weights over knot values -> weights over increments (value k = sum of increments 0..k)."""
    return np.cumsum(weights[::-1])[::-1]


def nnls(a: np.ndarray, b: np.ndarray, tol: float = 1e-12) -> np.ndarray:
    """min ||a x - b|| subject to x >= 0 (Lawson and Hanson's active-set method)."""
    n = a.shape[1]
    passive = np.zeros(n, dtype=bool)
    x = np.zeros(n)
    for _ in range(3 * n):
        gradient = a.T @ (b - a @ x)
        if passive.all() or gradient[~passive].max() <= tol:
            break
        passive[np.argmax(np.where(passive, -np.inf, gradient))] = True
        while True:
            z = np.zeros(n)
            z[passive] = np.linalg.lstsq(a[:, passive], b, rcond=None)[0]
            if (z[passive] > tol).all():
                break
            shrinking = passive & (z <= tol)
            alpha = np.min(x[shrinking] / (x[shrinking] - z[shrinking]))
            x = x + alpha * (z - x)
            passive &= x > tol
            x[~passive] = 0.0
        x = z
    return x


def fit_steps(samples: list[StepSample]) -> StepFit:
    if len(samples) < 4:
        raise ValueError(f"need at least 4 timed steps to fit the cost model, got {len(samples)}")
    token_knots = knots_for([s.tokens for s in samples])
    sampled = [s.sampled for s in samples if s.sampled]
    head_knots = knots_for(sampled or [1])
    nt, nh = len(token_knots), len(head_knots)
    seconds = np.array([s.seconds for s in samples])
    # Unknowns are the curves' increments between knots (>= 0, so both curves rise with the count):
    # a value is the sum of the increments up to its knot.
    base = np.array([np.concatenate(([s.requests], increments(hat_weights(s.tokens, token_knots)),
                                     increments(hat_weights(s.sampled, head_knots)))) for s in samples])
    pairs = np.array([s.pairs for s in samples], dtype=float)
    kv = np.array([s.kv_tokens for s in samples], dtype=float)
    pair_side = pairs > kv  # start: decode steps (a pair per KV entry read) on the KV side, prefill on pairs
    solution = None
    for _ in range(ALTERNATIONS):
        a = np.column_stack([base, np.where(pair_side, pairs, 0.0), np.where(pair_side, 0.0, kv)])
        scale = np.linalg.norm(a, axis=0)
        scale[scale == 0] = 1.0
        weighted = a / seconds[:, None]  # relative error: every step counts alike
        solution = nnls(weighted / scale, np.ones(len(samples))) / scale
        pair_cost, kv_cost = solution[-2], solution[-1]
        new_side = pair_cost * pairs >= kv_cost * kv
        if (new_side == pair_side).all():
            break
        pair_side = new_side
    fit = StepFit(
        layers=PiecewiseLinear(tuple(token_knots), tuple(np.cumsum(solution[1:1 + nt]).tolist())),
        lm_head=PiecewiseLinear(tuple(head_knots), tuple(np.cumsum(solution[1 + nt:1 + nt + nh]).tolist())),
        request_overhead_s=float(solution[0]), pair_cost_s=float(solution[-2]), kv_cost_s=float(solution[-1]),
        mean_abs_rel_error=0.0, max_abs_rel_error=0.0)
    errors = [abs(fit.predict(s) / s.seconds - 1) for s in samples]
    return replace(fit, mean_abs_rel_error=float(np.mean(errors)), max_abs_rel_error=float(np.max(errors)))
