"""Fitting the lab's step-cost model to step times measured on the real engine (`servelab lab profile`).

A timed step is reduced to the totals the CostModelExecutor prices a StepPlan by (executor/cost_model.py
plan_totals: tokens, sampled rows, requests, attention (query, key) pairs and KV entries touched). The
model fitted is the cost model's own shape for a measured device:

    seconds = request_overhead * requests + layers(tokens) + lm_head(sampled)
              + max(pair_cost * pairs, kv_cost * kv_tokens)

with layers() and lm_head() non-decreasing piecewise-linear curves (values at knots) and every
constant >= 0. The
max() is fitted by alternating: assign each step to the side of max() the current constants pick
(first: decode steps to the KV side, prefill to the pairs side),
solve a non-negative least-squares problem on relative error, repeat until the assignment settles.
The fit becomes a CostModel (fitted_cost_model), and that prices every step from then on, the fit's
own errors included.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from servelab.core.plan import ScheduledRequest, StepPlan
from servelab.executor.cost_model import CostModel, StepTotals, plan_totals
from servelab.executor.efficiency import Efficiency
from servelab.executor.curve import PiecewiseLinear
from servelab.lab.catalog import LOCAL_CPU
from servelab.sampling_params import SamplingParams
from servelab.specs import DTYPE_BYTES, DeviceSpec, ModelSpec, kv_dtype

# (num_computed_tokens, num_new_tokens, sample) of each request in a step, as a StepPlan holds them.
StepShape = list[tuple[int, int, bool]]
TOKEN_KNOTS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
ALTERNATIONS = 8


@dataclass(frozen=True)
class TimedStep:
    totals: StepTotals
    seconds: float


def shape_plan(shape: StepShape) -> StepPlan:
    """A StepPlan of this shape as the executor alone sees it (no new arrivals); token ids and blocks
    are blank, pricing reads only their counts."""
    params = SamplingParams(max_tokens=1)
    return StepPlan([ScheduledRequest(f"step-{i}", [0] * n, computed, [], sample, params)
                     for i, (computed, n, sample) in enumerate(shape)])


def step_sample(shape: StepShape, seconds: float) -> TimedStep:
    return TimedStep(plan_totals(shape_plan(shape)), seconds)


@dataclass(frozen=True)
class StepFit:
    layers: PiecewiseLinear
    lm_head: PiecewiseLinear
    request_overhead_s: float
    pair_cost_s: float  # seconds per (query, key) pair, all layers
    kv_cost_s: float  # seconds per KV entry read or written, all layers
    mean_abs_rel_error: float
    max_abs_rel_error: float


def fitted_device(fit: StepFit, model: ModelSpec, dtype: str, name: str = "this machine's CPU",
                  memory_bytes: int = 0, quantization: str = "none") -> DeviceSpec:
    """Effective FLOP/s from the layers curve's slope at its largest knots, effective weight-streaming
    bandwidth from one token's step (the layers' weights read once, a byte each under --quantization int8):
    what the meters call capacity."""
    xs, ys = fit.layers.xs, fit.layers.ys
    slope = (ys[-1] - ys[-2]) / (xs[-1] - xs[-2])
    layer_params = model.decoder_matmul_params
    flops = 2 * layer_params / slope if slope > 0 else 1e12
    one_token = fit.layers(1)
    weight_bytes = 1 if quantization == "int8" else DTYPE_BYTES[dtype]
    bandwidth = layer_params * weight_bytes / one_token if one_token > 0 else 1e12
    return DeviceSpec(id=LOCAL_CPU, name=name, flops=flops, memory_bandwidth=bandwidth, memory_bytes=memory_bytes,
                      interconnect="none", interconnect_bandwidth=0.0, network_bandwidth=0.0, gpus_per_node=1,
                      source="servelab lab profile")


def fitted_efficiency(fit: StepFit, model: ModelSpec, device: DeviceSpec, dtype: str,
                      kv_cache_dtype: str = "auto") -> Efficiency:
    """The measured curves and constants as the cost model reads them: attention and kv_memory are the
    fractions of the device's figures that give pair_cost and kv_cost (kv_cost over the bytes of a token
    in the cache's dtype, as the cost model prices them)."""
    flops_per_pair = model.num_hidden_layers * model.layer_score_flops_per_pair()
    kv_bytes = model.kv_bytes_per_token(kv_dtype(dtype, kv_cache_dtype))
    return Efficiency(
        matmul=1.0, memory=1.0, interconnect=1.0, allreduce_latency_s=0.0,
        attention=flops_per_pair / (fit.pair_cost_s * device.flops) if fit.pair_cost_s else 1.0,
        kv_memory=kv_bytes / (fit.kv_cost_s * device.memory_bandwidth) if fit.kv_cost_s else 1.0,
        step_overhead_s=0.0, request_overhead_s=fit.request_overhead_s,
        layers_curve=fit.layers, lm_head_curve=fit.lm_head)


def fitted_cost_model(fit: StepFit, model: ModelSpec, dtype: str, kv_cache_dtype: str = "auto") -> CostModel:
    """The cost model of the fitted steps alone (no serving overhead)."""
    device = fitted_device(fit, model, dtype)
    return CostModel(model, device, fitted_efficiency(fit, model, device, dtype, kv_cache_dtype), dtype=dtype,
                     kv_cache_dtype=kv_cache_dtype)


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


def _alternate(base, pairs, kv, seconds, pair_side):
    """NNLS of the relative errors with each step's attention on its side, re-deciding the sides until they hold:
    (solution, sum of squared relative errors)."""
    solution = None
    for _ in range(ALTERNATIONS):
        a = np.column_stack([base, np.where(pair_side, pairs, 0.0), np.where(pair_side, 0.0, kv)])
        scale = np.linalg.norm(a, axis=0)
        scale[scale == 0] = 1.0
        weighted = a / seconds[:, None]  # relative error: every step counts alike
        solution = nnls(weighted / scale, np.ones(len(seconds))) / scale
        pair_cost, kv_cost = solution[-2], solution[-1]
        new_side = pair_cost * pairs >= kv_cost * kv
        if (new_side == pair_side).all():
            break
        pair_side = new_side
    # the priced steps: each at the larger of its two attention terms
    attention = np.maximum(solution[-2] * pairs, solution[-1] * kv)
    predicted = base @ solution[:-2] + attention
    return solution, float(np.sum((predicted / seconds - 1) ** 2))


def fit_steps(samples: list[TimedStep], model: ModelSpec, dtype: str, kv_cache_dtype: str = "auto") -> StepFit:
    if len(samples) < 4:
        raise ValueError(f"need at least 4 timed steps to fit the cost model, got {len(samples)}")
    totals = [s.totals for s in samples]
    token_knots = knots_for([t.num_tokens for t in totals])
    sampled = [t.num_sampled for t in totals if t.num_sampled]
    head_knots = knots_for(sampled or [1])
    nt, nh = len(token_knots), len(head_knots)
    seconds = np.array([s.seconds for s in samples])
    # Unknowns are the curves' increments between knots (>= 0, so both curves rise with the count):
    # a value is the sum of the increments up to its knot.
    base = np.array([np.concatenate(([t.num_requests], increments(hat_weights(t.num_tokens, token_knots)),
                                     increments(hat_weights(t.num_sampled, head_knots)))) for t in totals])
    pairs = np.array([t.num_pairs for t in totals], dtype=float)
    kv = np.array([t.num_kv_tokens for t in totals], dtype=float)
    # Each step's attention is the larger of its pair and KV terms, so which side a step is on is part of the fit:
    # alternate between solving with the sides fixed and re-deciding them, from more than one start, and keep the
    # least-squares best. From the decode-like start alone (a step with more pairs than KV entries on the pair
    # side) a noisy grid can settle where the pair cost is tiny and long-context prefills sit on the KV side,
    # priced at a fifth of their time (a real profile: mean error 15.5%, a 3,072-token-context chunk -86%).
    prefill = np.array([t.num_tokens > t.num_requests for t in totals])
    solution, best = None, np.inf
    for start in (pairs > kv, prefill | (pairs > kv), np.ones(len(samples), dtype=bool)):
        candidate, residual = _alternate(base, pairs, kv, seconds, start)
        if residual < best - 1e-12:
            solution, best = candidate, residual
    fit = StepFit(
        layers=PiecewiseLinear(tuple(token_knots), tuple(np.cumsum(solution[1:1 + nt]).tolist())),
        lm_head=PiecewiseLinear(tuple(head_knots), tuple(np.cumsum(solution[1 + nt:1 + nt + nh]).tolist())),
        request_overhead_s=float(solution[0]), pair_cost_s=float(solution[-2]), kv_cost_s=float(solution[-1]),
        mean_abs_rel_error=0.0, max_abs_rel_error=0.0)
    cost_model = fitted_cost_model(fit, model, dtype, kv_cache_dtype)
    errors = [abs(cost_model.price(s.totals)["total"] / s.seconds - 1) for s in samples]
    return replace(fit, mean_abs_rel_error=float(np.mean(errors)), max_abs_rel_error=float(np.max(errors)))
