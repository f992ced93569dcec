"""Calibration profiles: the fitted GPU constants stay physically plausible, each cost-model term does what
its name says, users' vLLM result files load, and the fit recovers constants it was given."""
import json
from dataclasses import replace

import numpy as np
import pytest

from servelab.core.plan import ScheduledRequest, StepPlan
from servelab.errors import FieldError
from servelab.executor.cost_model import CostModel
from servelab.executor.efficiency import ENGINE_PRIORS, ENGINES, GPU_EFFICIENCY
from servelab.executor.cost_model_executor import CostModelExecutor
from servelab.lab.api import DeploymentRequest, SimulateRequest, simulate
from servelab.lab.calibrate.reference.cross_validation import PriorJacobian, cross_validate, fold_start
from servelab.lab.calibrate.reference.reference_fit import candidate_keys, depends, fit, prior, simulate_target, start_value
from servelab.lab.calibrate.targets import Target, measurement_targets, reference_targets
from servelab.lab.catalog import get_device, get_model, gpu_ids
from servelab.lab.catalog.calibration import (BOUND_REASONS, BOUNDS, CalibrationProfile, calibration_names,
                                              link_kind, load_calibration, with_family_defaults)
from servelab.lab.catalog.reference import DeploymentFields
from servelab.sampling_params import SamplingParams
from servelab.workload import WorkloadConfig

PUBLIC = load_calibration()
EFFICIENCIES = ("matmul", "attention", "memory", "kv_memory", "interconnect")


def test_shipped_profile_is_the_default_and_its_constants_are_plausible():
    assert "public" in calibration_names() and PUBLIC.name == "public"
    assert set(PUBLIC.engines()) >= set(ENGINES)
    for key, value in PUBLIC.values.items():
        low, high = BOUNDS[key.rsplit(".", 1)[1]]
        assert low <= value <= high, key
    for gpu in gpu_ids():
        device = get_device(gpu)
        for engine in PUBLIC.engines():
            e = PUBLIC.efficiency(device, engine)
            assert all(0 < getattr(e, name) <= 1 for name in EFFICIENCIES), (gpu, engine)
            assert 0 < e.step_overhead_s <= 10e-3
            assert 1e-6 <= e.allreduce_latency_s <= 100e-6
            assert 0 <= e.api_ttft_overhead_s <= 0.1 and 0 <= e.api_final_overhead_s <= 0.1


def test_the_fit_reports_held_out_errors_for_every_point():
    points = PUBLIC.fit["points"]
    assert len(points) >= 30
    for p in points:
        assert p["held_out_error"] is not None, p["id"]
    summary = PUBLIC.fit["summary"]
    assert summary["cross_validation"] == "leave-one-source-out"
    fitted = [p for p in points if p["in_fit"]]
    assert summary["num_points"] == len(fitted) and summary["num_sources"] == len({p["source"] for p in fitted})
    assert summary["held_out_mean_abs_error"] == pytest.approx(
        sum(abs(p["held_out_error"]) for p in fitted) / len(fitted))
    # the sources the fit leaves out are predicted by it and reported apart
    others = [p for p in points if not p["in_fit"]]
    if others:
        assert summary["other_sources"]["num_points"] == len(others)
        assert not {p["source"] for p in others} & {p["source"] for p in fitted}


def test_every_bound_has_a_written_reason():
    assert set(BOUND_REASONS) == set(BOUNDS)


@pytest.mark.parametrize("key, value", [("constants.matmul", 1.2), ("links.nvlink.allreduce_latency_s", 0.5e-6),
                                        ("engines.vllm.step_overhead_s", 0.02)])
def test_constants_outside_their_bounds_are_refused(key, value):
    with pytest.raises(ValueError, match="outside"):
        CalibrationProfile("bad", {key: value})


def test_unknown_keys_are_refused():
    with pytest.raises(ValueError, match="scope"):
        CalibrationProfile("bad", {"gpus.h100.warp_speed": 1.0})


def test_the_most_specific_scope_wins():
    profile = CalibrationProfile("t", {"constants.step_overhead_s": 1e-3, "links.nvlink.step_overhead_s": 2e-3,
                                       "gpus.h100.step_overhead_s": 3e-3, "engines.sglang.step_overhead_s": 4e-3})
    h100, a100, l4 = get_device("h100"), get_device("a100-80gb"), get_device("l4")
    assert profile.efficiency(h100, "sglang").step_overhead_s == 4e-3
    assert profile.efficiency(h100, "vllm").step_overhead_s == 3e-3
    assert profile.efficiency(a100, "vllm").step_overhead_s == 2e-3
    assert link_kind(l4) == "pcie" and profile.efficiency(l4, "vllm").step_overhead_s == 1e-3
    assert profile.efficiency(l4, "vllm").matmul == GPU_EFFICIENCY.matmul  # no scope sets it: the prior


def test_gemm_efficiency_saturates_in_the_step_token_count():
    e = replace(GPU_EFFICIENCY, matmul=0.8, matmul_half_tokens=256.0)
    cm = CostModel(get_model("llama-3.1-8b"), get_device("h100"), e)
    per_token = [cm.weights_time(m, 0) / m for m in (64, 512, 4096, 32768, 262144)]
    assert per_token == sorted(per_token, reverse=True)
    params = cm.dense_params + cm.expert_params  # per layer: attention projections and the MLP
    peak_rate = 2 * cm.num_layers * params / (cm.device.flops * 0.8)  # at eff = e_max, never above
    peak_rate += cm.num_layers * cm.elementwise_bytes_per_token / cm.bandwidth  # each row's trips between GEMMs
    assert per_token[-1] > peak_rate and per_token[-1] == pytest.approx(peak_rate, rel=0.01)


def _plan(num_decodes: int, prefill_len: int = 0) -> StepPlan:
    params = SamplingParams(max_tokens=8)
    scheduled = [ScheduledRequest(str(i), [0], 100, [0], True, params) for i in range(num_decodes)]
    if prefill_len:
        scheduled.append(ScheduledRequest("p", [0] * prefill_len, 0, [1], True, params))
    return StepPlan(scheduled)


def test_cuda_graphs_spare_decode_steps_the_kernel_launches():
    e = replace(GPU_EFFICIENCY, layer_launch_overhead_s=40e-6)
    model, device = get_model("llama-3.1-8b"), get_device("h100")
    graphs, eager = (CostModelExecutor(CostModel(model, device, e, cuda_graphs=flag)) for flag in (True, False))
    launches = 40e-6 * model.num_hidden_layers
    decode = _plan(8)
    assert eager.execute(decode).breakdown["overhead"] == pytest.approx(
        graphs.execute(decode).breakdown["overhead"] + launches)
    mixed = _plan(8, prefill_len=64)  # prefills run eagerly either way
    assert eager.execute(mixed).breakdown["overhead"] == graphs.execute(mixed).breakdown["overhead"]


def test_multi_step_scheduling_spreads_cpu_work_and_delays_first_tokens():
    model, device = get_model("llama-3.1-8b"), get_device("h100")
    one, ten = (CostModel(model, device, GPU_EFFICIENCY, num_scheduler_steps=n) for n in (1, 10))
    assert ten.overhead_time(32, 32) == pytest.approx(one.overhead_time(32, 32) / 10)
    assert ten.overhead_time(32, 96) == one.overhead_time(32, 96)  # a prefill step is scheduled on its own
    workload = WorkloadConfig(num_prompts=40, input_len=200, output_len=50, request_rate=2.0)
    runs = [simulate(SimulateRequest(DeploymentRequest(num_scheduler_steps=n), workload)).evaluation.metrics
            for n in (1, 10, 10)]
    assert runs[1] == runs[2]  # deterministic
    # the wait for the block in flight: (N - 1) / 2 decode steps on average, about 4.5 TPOT here
    extra = runs[1]["mean_ttft_ms"] - runs[0]["mean_ttft_ms"]
    assert 3 * runs[1]["mean_tpot_ms"] < extra < 6 * runs[1]["mean_tpot_ms"]


def test_api_overheads_move_ttft_and_the_last_token_only():
    workload = WorkloadConfig(num_prompts=30, input_len=100, output_len=20, request_rate=1.0)
    base = CalibrationProfile("t", {"engines.vllm.step_overhead_s": 3e-4})
    api = CalibrationProfile("t", {"engines.vllm.step_overhead_s": 3e-4, "engines.vllm.api_ttft_overhead_s": 0.02,
                                   "engines.vllm.api_final_overhead_s": 0.01})
    fields = DeploymentFields("llama-3.1-8b", "h100", "bfloat16", 1, 1, None, None, None, "vllm", 1, True)
    targets = [Target(m, "t", fields, workload, m, 1.0) for m in ("mean_ttft_ms", "mean_e2el_ms", "mean_itl_ms")]
    before = [simulate_target(t, base) for t in targets]
    after = [simulate_target(t, api) for t in targets]
    assert after[0] == pytest.approx(before[0] + 20)
    assert after[1] == pytest.approx(before[1] + 30)
    assert after[2] == pytest.approx(before[2] + 10 / 19, rel=0.01)  # the closing chunk's extra gap, over 19 gaps


def test_unknown_calibration_or_engine_is_a_field_error():
    with pytest.raises(FieldError) as err:
        DeploymentRequest(calibration="no-such-profile").build()
    assert err.value.fields == ("calibration",)
    with pytest.raises(FieldError) as err:
        DeploymentRequest(engine="no-such-engine").build()
    assert err.value.fields == ("engine",)


def _vllm_result(tmp_path, **overrides):
    # the keys `vllm bench serve --save-result` writes (vllm/benchmarks/serve.py), without --save-detailed
    data = {"date": "20260101-000000", "endpoint_type": "vllm", "label": None, "model_id": "meta-llama/Llama-3.1-8B",
            "tokenizer_id": "meta-llama/Llama-3.1-8B", "num_prompts": 200, "request_rate": 4.0, "burstiness": 1.0,
            "max_concurrency": None, "duration": 52.1, "completed": 200, "failed": 0, "total_input_tokens": 102400,
            "total_output_tokens": 25600, "request_throughput": 3.84, "request_goodput": None,
            "output_throughput": 491.4, "total_token_throughput": 2456.9, "mean_ttft_ms": 31.0,
            "median_ttft_ms": 29.5, "std_ttft_ms": 5.0, "p99_ttft_ms": 60.1, "mean_tpot_ms": 7.9,
            "median_tpot_ms": 7.8, "std_tpot_ms": 0.4, "p99_tpot_ms": 9.0, "mean_itl_ms": 7.9,
            "median_itl_ms": 7.6, "std_itl_ms": 1.0, "p99_itl_ms": 20.0, "mean_e2el_ms": 1040.0,
            "median_e2el_ms": 1030.0, "std_e2el_ms": 50.0, "p99_e2el_ms": 1200.0, **overrides}
    path = tmp_path / "vllm-4.0qps-Llama-3.1-8B.json"
    path.write_text(json.dumps(data))
    return path


def test_vllm_bench_result_files_become_targets(tmp_path):
    fields = DeploymentFields("llama-3.1-8b", "h100", "bfloat16", 1, 1, None, None, None, "vllm", 1, True)
    targets = measurement_targets(_vllm_result(tmp_path), fields)
    by_metric = {t.metric: t for t in targets}
    assert by_metric["median_ttft_ms"].value == 29.5 and by_metric["output_throughput"].value == 491.4
    w = targets[0].workload
    assert (w.num_prompts, w.input_len, w.output_len, w.request_rate) == (200, 512, 128, 4.0)
    detailed = measurement_targets(_vllm_result(tmp_path, input_lens=[400, 600], output_lens=[100, 156], completed=2),
                                   fields)
    assert (detailed[0].workload.input_len, detailed[0].workload.output_len) == (500, 128)
    assert detailed[0].workload.range_ratio == pytest.approx(0.22, abs=0.01)
    with pytest.raises(ValueError, match="completed"):
        measurement_targets(_vllm_result(tmp_path, completed=0, num_prompts=0), fields)


def test_the_fit_recovers_constants_it_was_given_and_cross_validates_deterministically():
    # the fit starts at the priors and finds what the data say
    truth = CalibrationProfile("truth", {"engines.sglang.step_overhead_s": 2e-3,
                                         "engines.sglang.api_ttft_overhead_s": 0.015, "gpus.h100.memory": 0.6})
    fields = DeploymentFields("llama-3.1-8b", "h100", "bfloat16", 1, 1, None, None, None, "sglang", 1, True)
    targets = []
    for rate, out in ((1.0, 40), (2.0, 80), (4.0, 20)):
        workload = WorkloadConfig(num_prompts=20, input_len=300, output_len=out, request_rate=rate)
        for metric in ("median_ttft_ms", "median_tpot_ms"):
            probe = Target(f"{rate}-{metric}", "t", fields, workload, metric, 1.0)
            targets.append(replace(probe, value=simulate_target(probe, truth)))
    # a decode step's weight streaming and its fixed overhead both add to TPOT alike at small batches: the fit
    # is given the bandwidth and finds the overheads (TPOT gives the step's, TTFT the API server's)
    keys = ["engines.sglang.step_overhead_s", "engines.sglang.api_ttft_overhead_s"]
    fixed = {"gpus.h100.memory": 0.6}
    start = {"engines.sglang.step_overhead_s": 1e-3}  # nearer than the prior: a few iterations suffice
    result = fit(targets, start=start, keys=keys, iterations=10, num_prompts=None, fixed=fixed)
    for key in keys:
        assert result.values[key] == pytest.approx(truth.values[key], rel=0.1), key
    # three sources, one per rate: each is predicted by a fit to the other two, from the priors
    targets = [replace(t, source=t.id.split("-")[0]) for t in targets]
    held_out = cross_validate(targets, start=start, keys=keys, iterations=6, num_prompts=None, fixed=fixed)
    assert held_out == cross_validate(targets, start=start, keys=keys, iterations=6, num_prompts=None, fixed=fixed)
    assert all(abs(h / t.value - 1) < 0.1 for h, t in zip(held_out, targets))


def test_a_folds_start_and_fit_do_not_depend_on_its_held_out_points():
    fields = DeploymentFields("llama-3.1-8b", "h100", "bfloat16", 1, 1, None, None, None, "sglang", 1, True)
    targets = []
    for n, (rate, out) in enumerate(((1.0, 40), (2.0, 80), (4.0, 20))):
        workload = WorkloadConfig(num_prompts=12, input_len=300, output_len=out, request_rate=rate)
        targets.append(Target(f"p{n}", "t", fields, workload, "median_tpot_ms", 5.0 + n, source=f"s{n}"))
    keys = ["engines.sglang.step_overhead_s", "gpus.h100.memory"]
    # the start is the priors, whatever the points say
    assert fold_start(keys, {}) == {k: prior(k) for k in keys}
    jac = PriorJacobian(targets, keys, {}, {}, None)
    # each Jacobian row is its own point's: changing a point's measured value moves no other row
    moved = [replace(targets[0], value=50.0), *targets[1:]]
    other = PriorJacobian(moved, keys, {}, {}, None)
    assert np.array_equal(jac.matrix[1:], other.matrix[1:])
    # so the prediction of the held-out source s0 is the same whatever s0 measured
    before = cross_validate(targets, keys=keys, iterations=3, num_prompts=None)
    after = cross_validate(moved, keys=keys, iterations=3, num_prompts=None)
    assert before[0] == after[0]
    assert before[1:] != after[1:]  # while s0 trains the folds that hold out the others


def test_each_gpu_fits_its_own_gemm_fill_each_engine_its_launches_and_both_start_from_a_global_value():
    fields = DeploymentFields("llama-3.1-8b", "h100", "bfloat16", 1, 1, None, None, None, "vllm", 1, True)
    workload = WorkloadConfig(num_prompts=4, input_len=100, output_len=4)
    h100 = Target("h", "t", fields, workload, "median_tpot_ms", 1.0)
    a10 = Target("a", "t", replace(fields, gpu="a10g"), workload, "median_tpot_ms", 1.0)
    keys = candidate_keys([h100, a10])
    assert {"gpus.h100.matmul_half_tokens", "gpus.a10g.matmul_half_tokens"} <= set(keys)
    assert "constants.matmul_half_tokens" not in keys
    assert "engines.vllm.layer_launch_overhead_s" in keys  # eager launches are the stack's, not the GPU's
    assert depends("gpus.h100.matmul_half_tokens", h100) and not depends("gpus.h100.matmul_half_tokens", a10)
    assert start_value({"constants.matmul_half_tokens": 203.0}, "gpus.a10g.matmul_half_tokens") == 203.0
    assert start_value({}, "gpus.a10g.matmul_half_tokens") == GPU_EFFICIENCY.matmul_half_tokens


def test_gpus_without_points_take_their_familys_constants_not_a_mean_over_unlike_chips():
    fields = DeploymentFields("llama-3.1-8b", "h100", "bfloat16", 1, 1, None, None, None, "vllm", 1, True)
    workload = WorkloadConfig(num_prompts=4, input_len=100, output_len=4)
    h100 = Target("h", "t", fields, workload, "median_tpot_ms", 1.0)
    a100 = Target("a", "t", replace(fields, gpu="a100-80gb"), workload, "median_tpot_ms", 1.0)
    a10 = Target("q", "t", replace(fields, gpu="a10g", quantization="gptq-int4"), workload, "median_tpot_ms", 1.0)
    mi300x = Target("m", "t", replace(fields, gpu="mi300x"), workload, "median_tpot_ms", 1.0)
    values = with_family_defaults({"gpus.h100.memory": 0.7, "gpus.a100-80gb.memory": 0.8, "gpus.a10g.memory": 0.5,
                                   "gpus.mi300x.memory": 0.6}, [h100, a100, a10, mi300x])
    # the weight-quantized-only A10 does not stand for its family
    assert values["families.ampere.memory"] == 0.8 and values["families.hopper.memory"] == 0.7
    profile = CalibrationProfile("t", values)
    memory = {gpu: profile.efficiency(get_device(gpu)).memory for gpu in gpu_ids()}
    assert memory["h200"] == memory["h800"] == 0.7  # Hopper
    assert memory["b200"] == 0.7  # Blackwell: no fitted GPU, so its lineage (Hopper)
    assert memory["l4"] == memory["l40s"] == 0.8  # Ada from Ampere
    assert memory["mi325x"] == 0.6  # CDNA3
    assert memory["a10g"] == 0.5  # a GPU keeps its own fit


def test_every_engine_key_prices_with_its_priors_until_fitted():
    device = get_device("h100")
    empty = CalibrationProfile("t", {})
    for engine in ENGINES:
        e = empty.efficiency(device, engine)
        assert e.step_overhead_s == ENGINE_PRIORS[engine]["step_overhead_s"], engine
    # vLLM V1 (the default) spends far less CPU per step than V0
    assert ENGINE_PRIORS["vllm"]["step_overhead_s"] * 5 < ENGINE_PRIORS["vllm-v0"]["step_overhead_s"]
    fitted = CalibrationProfile("t", {"engines.vllm-v0.step_overhead_s": 6e-3})
    assert fitted.efficiency(device, "vllm-v0").step_overhead_s == 6e-3
    assert fitted.efficiency(device, "vllm").step_overhead_s == ENGINE_PRIORS["vllm"]["step_overhead_s"]
    # the published vLLM points ran 0.6.x: V0
    assert {t.engine for t in reference_targets() if "vllm" in t.engine} == {"vllm-v0"}


def test_vllm_overheads_are_pulled_towards_v0s_published_figures_where_the_data_cannot_split_them():
    # every vLLM reference point ran V0 (0.6.x): its priors are V0's CPU work between steps, other engines'
    # fields without a published engine figure stay GPU_EFFICIENCY's
    assert prior("engines.vllm-v0.request_overhead_s") == ENGINE_PRIORS["vllm-v0"]["request_overhead_s"] == 80e-6
    assert prior("engines.vllm-v0.step_overhead_s") == 4e-3
    assert prior("engines.tensorrt-llm.layer_launch_overhead_s") == GPU_EFFICIENCY.layer_launch_overhead_s
    # one request at a time: a step's fixed and per-request costs add alike, so the data fix only their sum
    # and the prior splits it; started at the V1-era split, the fit moves to V0's
    truth = CalibrationProfile("truth", {"engines.vllm-v0.step_overhead_s": 4e-3,
                                         "engines.vllm-v0.request_overhead_s": 80e-6, "gpus.h100.memory": 0.6})
    fields = DeploymentFields("llama-3.1-8b", "h100", "bfloat16", 1, 1, None, None, None, "vllm-v0", 1, True)
    workload = WorkloadConfig(num_prompts=6, input_len=100, output_len=30, request_rate=0.5)
    probe = Target("serial", "t", fields, workload, "median_tpot_ms", 1.0)
    target = replace(probe, value=simulate_target(probe, truth))
    keys = ["engines.vllm-v0.step_overhead_s", "engines.vllm-v0.request_overhead_s"]
    start = {"engines.vllm-v0.step_overhead_s": 4e-3 + 80e-6 - 3e-6, "engines.vllm-v0.request_overhead_s": 3e-6}
    result = fit([target], start=start, keys=keys, iterations=6, num_prompts=None, fixed={"gpus.h100.memory": 0.6})
    assert result.values["engines.vllm-v0.request_overhead_s"] == pytest.approx(80e-6, rel=0.3)
    assert result.values["engines.vllm-v0.step_overhead_s"] == pytest.approx(4e-3, rel=0.05)
