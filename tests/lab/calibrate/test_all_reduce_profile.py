"""The local-cpu profile's all-reduce: the alpha-beta fit, its JSON, the cost model pricing `-tp 3` on one
machine with it (the whole model's compute on the shared cores plus 2 all-reduces per layer and the
embedding's), and a real gloo timing between 2 processes."""
import dataclasses
import multiprocessing

import pytest

from servelab.executor.cost_model import CostModel

from servelab.executor.efficiency import AllReduceFit
from servelab.lab.calibrate.all_reduce import fit_all_reduce
from servelab.lab.catalog import get_model
from servelab.lab.catalog.cpu_profile import CpuProfile
from test_profile import make_profile

ALPHA, BETA = 80e-6, 2e9


def with_all_reduce(profile: CpuProfile) -> CpuProfile:
    fits = (AllReduceFit(2, 50e-6, 4e9, ((256, 5e-5),)), AllReduceFit(3, ALPHA, BETA))
    return dataclasses.replace(profile, efficiency=dataclasses.replace(profile.efficiency, all_reduce=fits))


def test_fit_recovers_latency_and_bandwidth():
    samples = [(b, ALPHA + b / BETA) for b in (256, 4096, 65536, 1 << 20, 8 << 20)]
    fit = fit_all_reduce(3, samples)
    assert fit.world_size == 3 and fit.samples == tuple(samples)
    assert fit.latency_s == pytest.approx(ALPHA, rel=1e-6) and fit.bytes_per_s == pytest.approx(BETA, rel=1e-6)
    with pytest.raises(ValueError, match="do not grow"):
        fit_all_reduce(2, [(256, 1e-3), (1 << 20, 1e-4)])


def test_profile_json_keeps_the_fits_and_counts_the_ranks_as_devices():
    profile = with_all_reduce(make_profile())
    loaded = CpuProfile.from_json(profile.to_json())
    assert loaded.efficiency.all_reduce == profile.efficiency.all_reduce
    assert loaded.device.gpus_per_node == 3
    assert CpuProfile.from_json(make_profile().to_json()).device.gpus_per_node == 1


def test_cost_model_prices_tp3_on_shared_cores_plus_measured_all_reduces():
    spec, profile = get_model("smollm2-135m"), with_all_reduce(make_profile())
    tp1 = CostModel(spec, profile.device, profile.efficiency, 1, "bfloat16")
    tp3 = CostModel(spec, profile.device, profile.efficiency, 3, "bfloat16")
    one, three = tp1.step_time(16, 16, 16, 16 * 300, 16 * 300), tp3.step_time(16, 16, 16, 16 * 300, 16 * 300)
    for part in ("weights", "attention", "overhead"):  # the same cores do all of it
        assert three[part] == one[part]
    all_reduce = ALPHA + 16 * spec.hidden_size * 2 / BETA  # 16 tokens of bf16 hidden state
    assert three["communication"] == pytest.approx((2 * spec.num_hidden_layers + 1) * all_reduce)
    with pytest.raises(ValueError, match="no all-reduce timing for tp 2"):
        CostModel(spec, make_profile().device, make_profile().efficiency, 2, "bfloat16")


def test_gloo_all_reduce_between_two_processes():
    from servelab.distributed.all_reduce_timing import time_all_reduce

    samples = time_all_reduce(2, repeats=3, message_bytes=(256, 1 << 20))
    assert [b for b, _ in samples] == [256, 1 << 20]
    assert all(0 < t < 10 for _, t in samples)
    assert multiprocessing.active_children() == []


def test_validate_simulates_stage_4_as_tp3_with_the_same_kv_blocks():
    from servelab.lab.calibrate.validate import simulated_metrics
    from servelab.workload import WorkloadConfig

    spec, config = get_model("smollm2-135m"), WorkloadConfig(num_prompts=12, input_len=64, output_len=16,
                                                             request_rate=1.0, seed=0)
    profile = CpuProfile.from_json(with_all_reduce(make_profile()).to_json())  # as `lab validate` loads it
    stage3 = simulated_metrics(profile, spec, "continuous", 32, config)
    stage4 = simulated_metrics(profile, spec, "tp", 32, config)
    assert stage4["completed"] == stage3["completed"] == 12
    # the same cores do the same work, plus 61 all-reduces per step of at least 80 us each
    assert stage4["median_tpot_ms"] > stage3["median_tpot_ms"] + (2 * spec.num_hidden_layers + 1) * ALPHA * 1e3
