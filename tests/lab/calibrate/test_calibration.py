"""Fitting the cost model to measured steps: curves, NNLS, recovery of known constants, and the cost
model pricing with measured curves."""
from dataclasses import replace

import numpy as np
import pytest

from servelab.core.plan import ScheduledRequest, StepPlan
from servelab.executor.cost_model import CostModel, StepTotals, plan_totals
from servelab.executor.efficiency import GPU_EFFICIENCY, Efficiency
from servelab.executor.cost_model_executor import CostModelExecutor
from servelab.executor.curve import PiecewiseLinear
from servelab.lab.calibrate.fit import (StepFit, TimedStep, fit_steps, fitted_cost_model, fitted_device, fitted_efficiency,
                                        hat_weights, knots_for, nnls, shape_plan, step_sample)
from servelab.lab.catalog import get_device, get_model
from servelab.lab.calibrate.step_timing import ProfileSettings, step_grid
from servelab.sampling_params import SamplingParams

SETTINGS = ProfileSettings(max_num_seqs=128, max_num_batched_tokens=1024, max_model_len=8192, num_blocks=5825,
                           block_size=16)


def test_piecewise_linear_interpolates_and_extends():
    c = PiecewiseLinear((1, 2, 4), (10.0, 12.0, 20.0))
    assert c(0) == 0.0 and c(1) == 10.0 and c(1.5) == 11.0 and c(3) == 16.0
    assert c(6) == 28.0  # last segment's slope 4 per unit
    assert PiecewiseLinear((1, 2), (1.0, 5.0))(0.5) == 0.0  # never below 0
    assert PiecewiseLinear.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="increase strictly"):
        PiecewiseLinear((1, 1), (0.0, 1.0))


def test_hat_weights_reproduce_interpolation():
    knots = (1, 2, 4, 8)
    values = np.array([3.0, 4.0, 7.0, 9.0])
    curve = PiecewiseLinear(knots, tuple(values))
    for x in (1, 1.5, 3, 8, 12):
        assert hat_weights(x, knots) @ values == pytest.approx(curve(x))
    assert knots_for([3, 100]) == (1, 2, 4, 8, 16, 32, 64, 128)


def test_nnls_matches_the_constrained_optimum():
    a = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    assert nnls(a, np.array([1.0, 2.0, 3.0])) == pytest.approx([1.0, 2.0])
    # the unconstrained optimum has x1 < 0: the constrained one sets it to 0 and refits x0
    x = nnls(a, np.array([2.0, -1.0, 1.0]))
    assert x == pytest.approx([1.5, 0.0])


def test_grid_respects_the_engine_limits():
    small = ProfileSettings(max_num_seqs=8, max_num_batched_tokens=128, max_model_len=600, num_blocks=40,
                            block_size=16)
    grid = step_grid(small)
    assert grid
    for shape in grid:
        assert len(shape) <= 8 and sum(n for _, n, _ in shape) <= 128
        assert sum(-(-(c + n) // 16) for c, n, _ in shape) <= 40
        assert all(c + n < 600 for c, n, _ in shape)


def test_fit_recovers_known_constants():
    model = get_model("smollm2-135m")
    truth = StepFit(layers=PiecewiseLinear((1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024),
                                           (0.020, 0.030, 0.036, 0.055, 0.095, 0.17, 0.33, 0.64, 1.2, 2.3, 4.7)),
                    lm_head=PiecewiseLinear((1, 2, 4, 8, 16, 32, 64, 128), (0.004, 0.005, 0.006, 0.008, 0.013,
                                                                            0.022, 0.040, 0.075)),
                    request_overhead_s=1e-4, pair_cost_s=2e-8, kv_cost_s=1e-7, mean_abs_rel_error=0,
                    max_abs_rel_error=0)
    true_steps = fitted_cost_model(truth, model, "bfloat16")
    samples = [step_sample(shape, 0.0) for shape in step_grid(SETTINGS)]
    samples = [replace(s, seconds=true_steps.price(s.totals)["total"]) for s in samples]
    fit = fit_steps(samples, model, "bfloat16")
    assert fit.max_abs_rel_error < 1e-6
    assert fit.pair_cost_s == pytest.approx(2e-8, rel=1e-4) and fit.kv_cost_s == pytest.approx(1e-7, rel=1e-4)
    # shapes the grid never timed are priced as the truth prices them, by the executor the simulator runs
    device = fitted_device(fit, model, "bfloat16")
    executor = CostModelExecutor(CostModel(model, device, fitted_efficiency(fit, model, device, "bfloat16")))
    for shape in ([(100, 1, True)] * 20 + [(0, 300, True)], [(0, 700, False)], [(900, 1, True)] * 40):
        expected = true_steps.price(plan_totals(shape_plan(shape)))["total"]
        assert executor.execute(shape_plan(shape)).duration == pytest.approx(expected, rel=1e-6)


def test_a_step_shape_has_the_totals_the_executor_prices():
    # a decode at context 10, a prefill chunk of 4 after 6 computed tokens (not sampled), a new prompt of 3
    sample = step_sample([(9, 1, True), (6, 4, False), (0, 3, True)], 0.5)
    pairs = 10 + (4 * 10 - 4 * 3 // 2) + (3 * 3 - 3 * 2 // 2)
    assert sample.totals == StepTotals(num_tokens=8, num_sampled=2, num_requests=3, num_pairs=pairs,
                                       num_kv_tokens=(10 + 1) + (10 + 4) + (3 + 3), num_arrivals=0)
    assert sample.seconds == 0.5


def test_cost_model_prices_with_measured_curves():
    layers, head = PiecewiseLinear((1, 4), (0.02, 0.05)), PiecewiseLinear((1, 4), (0.004, 0.010))
    e = Efficiency(matmul=1, attention=1, memory=1, kv_memory=1, interconnect=1, allreduce_latency_s=0,
                   step_overhead_s=0.001, request_overhead_s=0.0001, layers_curve=layers, lm_head_curve=head)
    model, device = get_model("smollm2-135m"), get_device("h100")
    cm = CostModel(model, device, e)
    assert cm.weights_time(3, 2) == pytest.approx(0.04 + 0.006)
    assert cm.weights_time(3, 0) == pytest.approx(0.04)
    params = SamplingParams(max_tokens=4)
    plan = StepPlan([ScheduledRequest("a", [1, 2, 3], 0, [0], True, params)])
    parts = CostModelExecutor(cm).execute(plan).breakdown
    assert parts["weights"] == pytest.approx(0.04 + 0.004) and parts["overhead"] == pytest.approx(0.0011)
    with pytest.raises(ValueError, match="no all-reduce timing for tp 3"):
        CostModel(model, device, e, tensor_parallel_size=3)


def test_the_step_that_starts_a_request_pays_its_arrival():
    e = replace(GPU_EFFICIENCY, arrival_overhead_s=0.025, layer_launch_overhead_s=0.0)  # launches: see test_cost_model
    cm = CostModel(get_model("smollm2-135m"), get_device("h100"), e)
    params = SamplingParams(max_tokens=4)
    new = ScheduledRequest("a", [1, 2, 3], 0, [0], True, params, prompt_token_ids=[1, 2, 3], output_token_ids=[])
    later_chunk = ScheduledRequest("b", [4, 5], 3, [1], True, params)
    decode = ScheduledRequest("c", [7], 9, [2], True, params)
    executor = CostModelExecutor(cm)
    with_arrival = executor.execute(StepPlan([new, decode])).breakdown["overhead"]
    without = executor.execute(StepPlan([replace(new, prompt_token_ids=None, output_token_ids=None), decode]))
    assert with_arrival - without.breakdown["overhead"] == pytest.approx(0.025)
    # a request continuing its prefill, or decoding, arrived long ago
    assert executor.execute(StepPlan([later_chunk, decode])).breakdown["overhead"] == pytest.approx(
        without.breakdown["overhead"])
    # a new request whose first 16 tokens hit the prefix cache arrives as much as one that hit nothing
    hit = replace(new, num_computed_tokens=16, block_ids=[0, 4])
    assert executor.execute(StepPlan([hit, decode])).breakdown["overhead"] == pytest.approx(with_arrival)
    # a request the executor learns of part-way through, with outputs (resumed, or handed over after a remote
    # prefill), is not a new arrival
    resumed = ScheduledRequest("d", [8], 5, [3], True, params, prompt_token_ids=[1, 2, 3], output_token_ids=[4, 5])
    assert executor.execute(StepPlan([resumed, decode])).breakdown["overhead"] == pytest.approx(
        without.breakdown["overhead"])


def test_the_fit_finds_the_attention_side_of_a_real_grid():
    """A real `lab profile --quick` grid (tests/lab/calibrate/data/xeon_quick_grid.json) on which the fit started
    from the decode-like side assignment alone settled at a tiny pair cost (mean error 15.5%, a 256-token chunk
    after 3,072 cached tokens priced 86% short): from several starts it prices those chunks by their pairs."""
    import json
    from pathlib import Path

    data = json.loads((Path(__file__).parent / "data" / "xeon_quick_grid.json").read_text())
    samples = [TimedStep(StepTotals(s["tokens"], s["sampled"], s["requests"], s["pairs"], s["kv_tokens"], 0, 0),
                         s["seconds"]) for s in data["steps"]]
    model = get_model("smollm2-135m")
    fit = fit_steps(samples, model, data["dtype"], data["kv_cache_dtype"])
    assert fit.mean_abs_rel_error < 0.08 and fit.max_abs_rel_error < 0.2
    cost_model = fitted_cost_model(fit, model, data["dtype"], data["kv_cache_dtype"])
    long = [s for s in samples if s.totals.num_pairs > 800_000]
    assert len(long) == 2
    for s in long:
        assert cost_model.price(s.totals)["total"] == pytest.approx(s.seconds, rel=0.2)
