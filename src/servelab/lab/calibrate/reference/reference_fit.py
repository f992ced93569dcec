"""Fit a calibration profile's constants to measured targets, and cross-validate it.

Least squares on log(simulated / measured) (relative errors, symmetric in over- and under-estimates),
Levenberg-Marquardt in log space of each constant, clipped to its physical bounds (BOUNDS), with a weak
pull towards the prior (GPU_EFFICIENCY; ENGINE_PRIORS for an engine's own overheads) so that a constant the
data cannot see stays where physics puts it. Every residual is a full simulation, so the Jacobian
re-simulates only the targets a constant can move (a GPU's constants move its points, an engine's its
points). Cross-validation (leave one source out, each fold from the priors) is
servelab.lab.calibrate.reference.cross_validation.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from servelab.executor.efficiency import ENGINE_PRIORS, GPU_EFFICIENCY
from servelab.lab.calibrate.target_simulation import simulate_target, stable_cap
from servelab.lab.calibrate.targets import Target
from servelab.lab.catalog.calibration import BOUNDS, CalibrationProfile, link_kind

# Constants every fit may move, per scope; a scope's constants are fitted only when a training target uses it.
GLOBAL_FIELDS = ("attention", "kv_memory", "attention_half_tokens")
# NCCL's ring over PCIe (often through the host bridge) reaches a far smaller share of its link than over NVLink
LINK_FIELDS = ("allreduce_latency_s", "interconnect")
# matmul_half_tokens per GPU: how many rows a GEMM needs to leave the weight-streaming regime is the chip's own,
# not only its SM count (which the cost model scales it by): a Hopper GEMM's TMA loads and warp-specialised
# wgmma pipelines hide the weight stream behind the math far better than Ampere's cp.async stages or CDNA's.
GPU_FIELDS = ("matmul", "memory", "matmul_half_tokens")
# layer_launch_overhead_s per engine: the CPU cost of launching a layer's kernels in a step no CUDA graph
# replays (prefills, --no-cuda-graphs) is the stack's own: Python module calls and eager PyTorch dispatch in
# vLLM and SGLang, a C++ runtime in TensorRT-LLM.
ENGINE_FIELDS = ("step_overhead_s", "request_overhead_s", "api_ttft_overhead_s", "api_final_overhead_s",
                 "layer_launch_overhead_s")
PRIOR_WEIGHT = 0.05  # per unit of log-distance from the prior, against residuals of ~0.1
MISSING = 2.0  # log-residual of a target whose deployment does not fit in memory
# A fit stops once an iteration lowers the cost by less than this share: the rest is simulation noise.
CONVERGED = 1e-4
# Each Jacobian costs a simulation per (constant, target it moves); between two, Broyden's secant updates
# (one simulation per target) steer this many iterations.
JACOBIAN_EVERY = 4


def candidate_keys(targets: list[Target]) -> list[str]:
    keys = [f"constants.{f}" for f in GLOBAL_FIELDS]
    keys += sorted({f"links.{link_kind(t.device)}.{f}" for t in targets if t.deployment.tp > 1 for f in LINK_FIELDS})
    keys += sorted({f"gpus.{t.gpu}.{f}" for t in targets for f in GPU_FIELDS})
    keys += sorted({f"engines.{t.engine}.{f}" for t in targets for f in ENGINE_FIELDS})
    return keys


def depends(key: str, target: Target) -> bool:
    scope, *rest = key.split(".")
    if scope == "constants":
        return True
    if scope == "links":
        return target.deployment.tp > 1 and link_kind(target.device) == rest[0]
    if scope == "gpus":
        return target.gpu == rest[0]
    return target.engine == rest[0]




def prior(key: str) -> float:
    scope, *rest = key.split(".")
    name = rest[-1]
    low, high = BOUNDS[name]
    engine = ENGINE_PRIORS.get(rest[0], {}) if scope == "engines" else {}
    value = engine.get(name, getattr(GPU_EFFICIENCY, name))
    return min(max(value, low), high) if value > 0 else math.sqrt(low * high) if high / low < 1e3 else low * 30


def start_value(start: dict[str, float], key: str) -> float:
    """key's value in a starting profile; else the value it inherits there from every GPU
    (constants.<field>: a profile fitted when the field was global); else the prior."""
    if key in start:
        return start[key]
    return start.get(f"constants.{key.rsplit('.', 1)[1]}", prior(key))


@dataclass
class FitResult:
    values: dict[str, float]
    cost: float
    iterations: int
    keys: list[str]
    jacobian: np.ndarray  # d log(simulated) / d log(constant) near the fit (Broyden-updated), one row per target
    caps: dict[str, int | None]  # requests simulated per target id while fitting (None: all)
    log: list[str] = field(default_factory=list)


class _Problem:
    def __init__(self, targets: list[Target], keys: list[str], fixed: dict[str, float], caps: dict[str, int | None]):
        self.targets, self.keys, self.fixed, self.caps = targets, keys, fixed, caps
        self.low = np.log([BOUNDS[k.rsplit(".", 1)[1]][0] for k in keys])
        self.high = np.log([BOUNDS[k.rsplit(".", 1)[1]][1] for k in keys])
        self.x0 = np.log([prior(k) for k in keys])
        self.mask = np.array([[depends(k, t) for k in keys] for t in targets])

    def profile(self, x: np.ndarray) -> CalibrationProfile:
        return CalibrationProfile("fit", {**self.fixed, **_values(self.keys, x)})

    def residuals(self, x: np.ndarray, rows=None, base: np.ndarray | None = None) -> np.ndarray:
        profile = self.profile(x)
        out = base.copy() if base is not None else np.zeros(len(self.targets))
        for i in (range(len(self.targets)) if rows is None else rows):
            t = self.targets[i]
            sim = simulate_target(t, profile, self.caps[t.id])
            out[i] = MISSING if sim is None or sim <= 0 else math.log(sim / t.value)
        return out

    def stacked(self, x: np.ndarray, r: np.ndarray) -> np.ndarray:
        return np.concatenate([r, PRIOR_WEIGHT * (x - self.x0)])

    def cost(self, x: np.ndarray, r: np.ndarray) -> float:
        return float(np.sum(self.stacked(x, r) ** 2))


def fit(targets: list[Target], start: dict[str, float] | None = None, keys: list[str] | None = None,
        iterations: int = 8, num_prompts: int | None = 300, progress: Callable[[str], None] = lambda s: None,
        fixed: dict[str, float] | None = None, jacobian: np.ndarray | None = None,
        caps: dict[str, int | None] | None = None, redifference: bool = True) -> FitResult:
    """jacobian: the first Jacobian (rows: targets, columns: keys), differenced at `start` by the caller;
    Broyden's secants update it. redifference False: never difference it again (cross-validation's folds,
    whose first Jacobian is the priors' rows of their training points). num_prompts: the fewest requests a target is simulated with while fitting, raised per target until its
    metric stands still (stable_cap) at the start values; caps: those counts, already chosen."""
    keys = keys or candidate_keys(targets)
    start = start or {}
    x = np.array([math.log(start_value(start, k)) for k in keys])
    if caps is None:
        at_start = CalibrationProfile("start", {**(fixed or {}), **_values(keys, x)})
        caps = {t.id: stable_cap(t, at_start, num_prompts) for t in targets}
        progress(f"requests simulated per target while fitting: {caps}")
    problem = _Problem(targets, keys, fixed or {}, caps)
    x = np.clip(x, problem.low, problem.high)
    r = problem.residuals(x)
    cost = problem.cost(x, r)
    lam, h, log = 0.1, 0.05, []
    it, previous, stale, fresh = 0, cost, 0, False
    J = jacobian
    for it in range(1, iterations + 1):
        if redifference and (J is None or stale >= JACOBIAN_EVERY):
            J, stale, fresh = _jacobian(problem, x, r, h), 0, True
        Jf = np.vstack([J, PRIOR_WEIGHT * np.eye(len(keys))])
        f = problem.stacked(x, r)
        A, g = Jf.T @ Jf, Jf.T @ f
        improved = False
        while lam < 1e4:
            step = np.linalg.solve(A + lam * np.diag(np.diag(A)) + 1e-12 * np.eye(len(keys)), -g)
            x_new = np.clip(x + step, problem.low, problem.high)
            r_new = problem.residuals(x_new)
            cost_new = problem.cost(x_new, r_new)
            if cost_new < cost:
                dx = x_new - x  # Broyden: the secant this step measured, within each target's constants
                J = J + np.outer(r_new - r - J @ dx, dx) / float(dx @ dx) * problem.mask
                stale, fresh = stale + 1, False
                x, r, cost, improved = x_new, r_new, cost_new, True
                lam = max(lam / 3, 1e-4)
                break
            lam *= 4
        rms = math.sqrt(float(np.mean(r ** 2)))
        log.append(f"iteration {it}: cost {cost:.4f}, rms log-error {rms:.3f}, lambda {lam:.0e}")
        progress(log[-1])
        stalled = not improved or previous - cost < CONVERGED * previous
        previous = cost
        if stalled and redifference and not fresh:  # the updated Jacobian leads nowhere: difference anew
            stale, lam = JACOBIAN_EVERY, 0.1
            continue
        if stalled or float(np.max(np.abs(g))) < 1e-6:
            break
    if J is None:
        J = _jacobian(problem, x, r, h)
    return FitResult({**(fixed or {}), **_values(keys, x)}, cost, it, keys, J, caps, log)


def _values(keys: list[str], x: np.ndarray) -> dict[str, float]:
    """exp(log(bound)) can land a rounding error outside the bound: clamp."""
    out = {}
    for key, v in zip(keys, x):
        low, high = BOUNDS[key.rsplit(".", 1)[1]]
        out[key] = min(max(float(math.exp(v)), low), high)
    return out


def _jacobian(problem: _Problem, x: np.ndarray, r: np.ndarray, h: float) -> np.ndarray:
    J = np.zeros((len(problem.targets), len(problem.keys)))
    for j in range(len(problem.keys)):
        rows = np.flatnonzero(problem.mask[:, j])
        if not len(rows):
            continue
        xj = x.copy()
        # step inwards at the upper bound, so the difference stays inside the box
        xj[j] += h if x[j] + h <= problem.high[j] else -h
        rj = problem.residuals(xj, rows, r)
        J[:, j] = (rj - r) / (xj[j] - x[j])
    return J
