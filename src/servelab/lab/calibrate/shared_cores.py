"""One engine instance among several on this machine's cores, for the local-cpu profile.

`servelab serve --data-parallel-size 2` and `--disaggregate 1:1` give each engine process cores // 2 threads. How
much slower a step gets on fewer threads depends on the step: a long prefill's GEMMs and attention scale with the
threads, a decode step of a few rows (latency- and bandwidth-bound) much less. So `lab profile` times its step grid
again at that thread count and fits it like the main grid; `lab validate`'s stages 5 and 6 price each instance
with that fit (CpuProfile.shared_efficiency), and with the old assumption, every curve stretched by the number of
instances, only for a profile without it (shared_cores below).
"""
from __future__ import annotations

from dataclasses import replace
from typing import Callable

from servelab.executor.curve import PiecewiseLinear
from servelab.executor.efficiency import Efficiency

INSTANCES = 2  # the validated stages split the cores in two: -dp 2, --disaggregate 1:1


def measure_shared_cores(engine, spec, dtype: str, kv_cache_dtype: str, repeats: int,
                         log: Callable[[str], None]):
    """The quick step grid at cores // INSTANCES threads on this engine, fitted: (StepFit, threads each), or None
    on a machine with fewer threads than instances."""
    import torch

    from servelab.lab.calibrate.fit import fit_steps
    from servelab.lab.calibrate.step_timing import measure_steps

    threads = torch.get_num_threads()
    each = threads // INSTANCES
    if each < 1:
        return None
    torch.set_num_threads(each)
    try:
        samples = measure_steps(engine, repeats=repeats, quick=True,
                                progress=lambda line: log(f"{INSTANCES} instances, {each} thread(s) each: {line}"))
    finally:
        torch.set_num_threads(threads)
    fit = fit_steps(samples, spec, dtype, kv_cache_dtype)
    log(f"{INSTANCES} instances, {each} thread(s) each: step fit over {len(samples)} shapes: mean error "
        f"{fit.mean_abs_rel_error:.1%}, max {fit.max_abs_rel_error:.1%}")
    return fit, each, len(samples)


def shared_cores_json(measured, spec, device, dtype: str, kv_cache_dtype: str) -> dict:
    """CpuProfile.shared_cores of measure_shared_cores' answer, its rates as fractions of the profile's device."""
    from servelab.lab.calibrate.fit import fitted_efficiency

    if measured is None:
        return {}
    fit, each, num_samples = measured
    e = fitted_efficiency(fit, spec, device, dtype, kv_cache_dtype)
    return {"instances": INSTANCES, "threads": each,
            "efficiency": {"layers_curve": e.layers_curve.to_json(), "lm_head_curve": e.lm_head_curve.to_json(),
                           "attention": e.attention, "kv_memory": e.kv_memory,
                           "request_overhead_s": e.request_overhead_s},
            "fit": {"num_samples": num_samples, "mean_abs_rel_error": fit.mean_abs_rel_error,
                    "max_abs_rel_error": fit.max_abs_rel_error}}


def stretched(efficiency: Efficiency, num_instances: int) -> Efficiency:
    """The assumption for a profile without a measured shared_cores: one of num_instances engine processes takes
    num_instances times as long for everything the curves and fitted rates price."""
    def stretch(curve):
        return None if curve is None else PiecewiseLinear(curve.xs, tuple(y * num_instances for y in curve.ys))

    e = efficiency
    return replace(e, matmul=e.matmul / num_instances, attention=e.attention / num_instances,
                   memory=e.memory / num_instances, kv_memory=e.kv_memory / num_instances,
                   layers_curve=stretch(e.layers_curve), lm_head_curve=stretch(e.lm_head_curve))


def shared_cores(profile, num_instances: int) -> Efficiency:
    """The efficiency of one of num_instances engine processes splitting the profiled cores: measured when the
    profile has it for that many, stretched otherwise."""
    return profile.shared_efficiency(num_instances) or stretched(profile.efficiency, num_instances)
