"""Three facts of the published runs the lab now prices (calib3): GEMM saturation that scales with the chip's
SMs/CUs, a benchmark's own arrival trace (numpy's legacy generator, as vLLM's benchmark_serving.py draws
it), and a disaggregation proxy that waits for the prefill instance's asynchronous output."""
import math
from dataclasses import replace

import numpy as np
import pytest

from servelab.errors import FieldError
from servelab.executor.cost_model import CostModel
from servelab.executor.efficiency import GPU_EFFICIENCY, REFERENCE_COMPUTE_UNITS, matmul_half_tokens
from servelab.lab.calibrate.target_simulation import simulate_target
from servelab.lab.calibrate.targets import Target
from servelab.lab.catalog import get_device, get_model
from servelab.lab.catalog.calibration import CalibrationProfile
from servelab.lab.catalog.lookup import gpu_ids
from servelab.lab.catalog.reference import DeploymentFields, load_reference_points, to_simulation
from servelab.lab.sim.simulate import simulate
from servelab.workload import WorkloadConfig, generate_workload

QWEN, H100 = get_model("qwen2.5-7b"), get_device("h100")


def test_every_catalog_gpu_states_its_compute_units():
    units = {g: get_device(g).compute_units for g in gpu_ids()}
    assert all(isinstance(n, int) and 40 <= n <= 400 for n in units.values()), units
    assert units["h100"] == REFERENCE_COMPUTE_UNITS and units["a10g"] < units["a100-80gb"] < units["mi300x"]


def test_a_chip_with_fewer_sms_fills_at_fewer_rows():
    e = replace(GPU_EFFICIENCY, matmul=0.5, matmul_half_tokens=160.0)
    half_size = replace(H100, id="h100-half", compute_units=66)
    assert matmul_half_tokens(e, H100) == 160.0
    assert matmul_half_tokens(e, half_size) == 80.0
    assert matmul_half_tokens(e, replace(H100, compute_units=None)) == 160.0  # a measured profile: as fitted
    # a compute-bound prefill of M rows costs (M + half) rows' FLOPs: less on the smaller chip at equal peak
    # (its rows' trips through memory between the GEMMs cost both chips alike)
    big, small = (CostModel(QWEN, d, e) for d in (H100, half_size))
    rows = big.num_layers * 2000 * big.elementwise_bytes_per_token / big.bandwidth
    assert (small.weights_time(2000, 0) - rows) / (big.weights_time(2000, 0) - rows) == pytest.approx(
        (2000 + 80) / (2000 + 160), rel=1e-9)
    # and the saturation still rises with M on both (longer prompts never cheaper per step)
    for cost in (CostModel(QWEN, d, e) for d in (H100, half_size)):
        times = [cost.weights_time(m, 1) for m in (1, 64, 512, 4096)]
        assert times == sorted(times)


def test_numpy_legacy_arrivals_replay_benchmark_servings_trace():
    config = WorkloadConfig(num_prompts=200, input_len=1010, output_len=6, request_rate=6, seed=0,
                            arrival_rng="numpy-legacy")
    requests = generate_workload(config)
    np.random.seed(0)  # benchmark_serving.py: np.random.seed(args.seed), one gap drawn after each request
    gaps = [np.random.exponential(1.0 / 6) for _ in range(199)]
    assert [r.arrival_time for r in requests] == pytest.approx([0.0, *np.cumsum(gaps)], rel=1e-12)
    # the trace the Mooncake page's durations show: 196.44 s of gaps at rate 1
    assert requests[-1].arrival_time * 6 == pytest.approx(196.44, abs=0.01)
    # the lengths stay servelab's stream, so only the arrivals differ from the default
    default = generate_workload(replace(config, arrival_rng="servelab"))
    assert [(r.prompt_len, r.output_len) for r in requests] == [(r.prompt_len, r.output_len) for r in default]
    assert [r.arrival_time for r in requests] != [r.arrival_time for r in default]


def test_numpy_legacy_arrivals_are_checked():
    with pytest.raises(FieldError, match="arrival_rng"):
        WorkloadConfig(arrival_rng="mt19937")
    with pytest.raises(FieldError, match="rate_schedule"):
        WorkloadConfig(arrival_rng="numpy-legacy", rate_schedule="0-60s:2")


def test_the_mooncake_points_replay_their_benchmarks_trace():
    points = [p for p in load_reference_points() if p.id.startswith("mooncake-")]
    assert len(points) == 6
    assert {to_simulation(p).workload.arrival_rng for p in points} == {"numpy-legacy"}
    assert {to_simulation(p).workload.arrival_rng for p in load_reference_points()
            if not p.id.startswith("mooncake-")} == {"servelab"}


def _proxied(**kw) -> DeploymentFields:
    base = DeploymentFields("qwen2.5-7b", "a10g", "bfloat16", 2, 1, (1, 1), None, None, "vllm", 1, True,
                            first_token_from_decode=True, mixed_batches=False)
    return replace(base, **kw)


def _handoffs(fields: DeploymentFields, workload: WorkloadConfig):
    target = Target("t", "t", fields, workload, "mean_ttft_ms", 1.0)
    deployment = target.build(CalibrationProfile("t", {}).efficiency(target.device, target.engine))
    return simulate(deployment, target.requests())


def test_the_proxy_sends_a_prefill_on_when_the_prefill_instances_next_step_ends():
    # the second prompt arrives a millisecond or so after the first, while the first is in its prefill step,
    # so it runs in the prefill instance's next step
    workload = WorkloadConfig(num_prompts=2, input_len=1024, output_len=6, request_rate=1000.0)
    sync = _handoffs(_proxied(), workload)
    late = _handoffs(_proxied(async_output=True), workload)
    prefill = next(i for i in late.instances if i.role == "prefill")
    ends = list(prefill.step_stats.timeline)
    assert len(ends) == 2  # one prefill step each
    # without asynchronous output the first hand-off is the KV transfer alone; with it, the proxy only hears
    # of the first prefill when the second prefill step ends; the last, with nothing after it, at once
    assert sync.request_transfer_s[0] == pytest.approx(sync.kv_transfer_times[0])
    assert late.request_transfer_s[0] == pytest.approx(ends[1] - ends[0])
    assert late.request_transfer_s[1] == pytest.approx(late.kv_transfer_times[1])
    assert late.kv_transfer_times == pytest.approx(sync.kv_transfer_times)


def test_a_lone_prefill_is_handed_over_at_once_and_load_raises_ttft():
    profile = CalibrationProfile("t", {})
    lone = WorkloadConfig(num_prompts=10, input_len=1024, output_len=6, request_rate=0.05)
    busy = replace(lone, num_prompts=60, request_rate=4.0)
    ttft = {}
    for name, workload in (("lone", lone), ("busy", busy)):
        for flag in (False, True):
            fields = _proxied(async_output=flag)
            ttft[name, flag] = simulate_target(Target("t", "t", fields, workload, "median_ttft_ms", 1.0), profile)
    # asynchronous output adds the decode instance's next step at low load, nothing on the prefill side...
    decode_step = ttft["lone", True] - ttft["lone", False]
    assert 0 < decode_step < 0.2 * ttft["lone", False]
    # ...and under load the prefill side's next step too, so TTFT grows by more than that step
    assert ttft["busy", True] - ttft["busy", False] > 1.5 * decode_step
    assert math.isfinite(ttft["busy", True])
