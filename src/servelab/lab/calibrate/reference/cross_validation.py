"""Leave-one-source-out cross-validation: how well the lab predicts a published measurement whose source
document it has never seen.

Points of one source share a testbed, an engine build and a benchmark client, so dealing points into
folds one by one leaves rows of a held-out point's own table in training and measures interpolation
inside that table. Here every fold holds out one whole source, and its fit starts from the priors
(GPU_EFFICIENCY, ENGINE_PRIORS), never from a fit that has seen the held-out points. Its first Jacobian
is the priors' one, whose row of a point is that point's own derivative (each row depends on nothing but
its point and the start), so one Jacobian over all points serves every fold sliced to its training rows;
Broyden's secants update it within the fold, and no fold differences it again.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from servelab.lab.calibrate.reference.reference_fit import (_jacobian, _Problem, candidate_keys, fit, start_value,
                                                 stable_cap, _values)
from servelab.lab.calibrate.target_simulation import simulate_target
from servelab.lab.calibrate.targets import Target
from servelab.lab.catalog.calibration import CalibrationProfile, with_family_defaults


def sources(targets: list[Target]) -> list[str]:
    """The source documents, in the order their first point appears."""
    return list(dict.fromkeys(t.source for t in targets))


def fold_start(keys: list[str], start: dict[str, float]) -> dict[str, float]:
    """A fold's starting constants: `start`'s (the priors when empty; a profile fitted to other data when
    a user refits their own measurements), restricted to the fold's keys. Nothing here reads a point."""
    return {key: start_value(start, key) for key in keys}


class PriorJacobian:
    """The Jacobian at the start over all points, and the request caps chosen there; each fold slices it."""

    def __init__(self, targets: list[Target], keys: list[str], start: dict[str, float], fixed: dict[str, float],
                 num_prompts: int | None):
        self.targets, self.keys = targets, keys
        x = np.log([start_value(start, k) for k in keys])
        at_start = CalibrationProfile("start", {**fixed, **_values(keys, x)})
        self.caps = {t.id: stable_cap(t, at_start, num_prompts) for t in targets}
        problem = _Problem(targets, keys, fixed, self.caps)
        x = np.clip(x, problem.low, problem.high)
        self.matrix = _jacobian(problem, x, problem.residuals(x), 0.05)

    def rows(self, train: list[Target], keys: list[str]) -> np.ndarray:
        row = {t.id: n for n, t in enumerate(self.targets)}
        return self.matrix[np.ix_([row[t.id] for t in train], [self.keys.index(k) for k in keys])]


def cross_validate(targets: list[Target], start: dict[str, float] | None = None, keys: list[str] | None = None,
                   iterations: int = 3, num_prompts: int | None = 300, fixed: dict[str, float] | None = None,
                   progress: Callable[[str], None] = lambda s: None,
                   prior_jacobian: PriorJacobian | None = None) -> list[float | None]:
    """Each target's simulated value from a fit on the other sources' points alone (None: its deployment does
    not fit in memory). keys: the constants the folds may move (default: every one a training point uses);
    start: where each fold starts (default: the priors)."""
    start, fixed = start or {}, fixed or {}
    all_keys = keys or candidate_keys(targets)
    jac = prior_jacobian or PriorJacobian(targets, all_keys, start, fixed, num_prompts)
    held_out: list[float | None] = [None] * len(targets)
    names = sources(targets)
    for n, source in enumerate(names):
        train = [t for t in targets if t.source != source]
        test = [i for i, t in enumerate(targets) if t.source == source]
        if not train:
            continue
        fold_keys = [k for k in candidate_keys(train) if k in all_keys]
        result = fit(train, start=fold_start(fold_keys, start), keys=fold_keys, iterations=iterations,
                     num_prompts=num_prompts, fixed=fixed, jacobian=jac.rows(train, fold_keys), caps=jac.caps,
                     redifference=False, progress=lambda s, f=n: progress(f"fold {f + 1}/{len(names)} "
                                                                         f"(without {names[f]}): {s}"))
        profile = CalibrationProfile("fold", with_family_defaults(result.values, train))
        for i in test:
            held_out[i] = simulate_target(targets[i], profile)
    return held_out
