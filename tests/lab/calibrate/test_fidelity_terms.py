"""The deployment facts the GPU reference points needed beyond the cost model's constants (a weight-quantized
checkpoint, a disaggregation proxy that streams from the decode instance), and the calibration fit's
shortcuts: memoised simulations and request caps only where the metric stands still."""
import math
from dataclasses import replace

import pytest

from servelab.errors import FieldError
from servelab.executor.cost_model import CostModel
from servelab.executor.efficiency import GPU_EFFICIENCY
from servelab.lab.calibrate import target_simulation
from servelab.lab.calibrate.target_simulation import simulate_target, stable_cap
from servelab.lab.calibrate.targets import Target
from servelab.lab.catalog import get_device, get_model
from servelab.lab.catalog.calibration import CalibrationProfile
from servelab.lab.catalog.reference import DeploymentFields
from servelab.lab.sim.deployment import Deployment, plan_memory
from servelab.workload import WorkloadConfig

QWEN, A10 = get_model("qwen2.5-7b"), get_device("a10g")


def _fields(**kw) -> DeploymentFields:
    base = DeploymentFields("qwen2.5-7b", "a10g", "bfloat16", 2, 1, (1, 1), None, None, "vllm", 1, True)
    return replace(base, **kw)


def test_gptq_int4_weights_are_the_checkpoints_size():
    # Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4's safetensors hold 5.58 GB: int4 decoder GEMMs with group-128
    # scales and zeros, 16-bit embeddings and LM head
    assert QWEN.weight_bytes("bfloat16", "gptq-int4") == pytest.approx(5.58e9, rel=0.03)
    assert QWEN.weight_bytes("bfloat16") == pytest.approx(15.2e9, rel=0.03)


def test_int4_weights_speed_up_memory_bound_decode_not_compute_bound_prefill():
    # flat GEMM efficiency, so that a one-token step is priced by its bytes alone
    flat = replace(GPU_EFFICIENCY, matmul_half_tokens=0.0)
    bf16, int4 = (CostModel(QWEN, A10, flat, quantization=q) for q in (None, "gptq-int4"))
    assert int4.weights_time(1, 1) < 0.4 * bf16.weights_time(1, 1)
    assert int4.weights_time(4096, 1) == bf16.weights_time(4096, 1)
    # and they leave the KV cache more room
    memory = [plan_memory(Deployment(QWEN, A10, 1, quantization=q), 2048) for q in (None, "gptq-int4")]
    assert memory[1].kv_cache_bytes - memory[0].kv_cache_bytes == memory[0].weight_bytes - memory[1].weight_bytes


def test_unknown_quantization_and_a_proxy_without_disaggregation_are_refused():
    with pytest.raises(FieldError, match="quantization"):
        Deployment(QWEN, A10, 1, quantization="int3")
    with pytest.raises(FieldError, match="first_token_from_decode"):
        Deployment(QWEN, A10, 1, first_token_from_decode=True)


def test_a_proxy_streaming_from_the_decode_instance_delays_every_token_by_the_handoff_and_a_bypassed_step():
    workload = WorkloadConfig(num_prompts=20, input_len=1024, output_len=6, request_rate=0.5)
    profile = CalibrationProfile("t", {})
    metrics = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")
    direct = [simulate_target(Target(m, "t", _fields(), workload, m, 1.0), profile) for m in metrics]
    proxied = [simulate_target(Target(m, "t", _fields(first_token_from_decode=True), workload, m, 1.0), profile)
               for m in metrics]
    shift = proxied[0] - direct[0]
    # the KV handoff plus the decode instance's first step, which runs no decoder layer (vLLM's KV connector
    # bypasses the forward when it received the prompt's KV and last hidden state): an LM head and the
    # step's CPU work, well under half a decode step here, and more than nothing
    assert 0 < shift < 0.5 * direct[1]
    assert proxied[1] == pytest.approx(direct[1])  # the gaps between tokens do not change
    assert proxied[2] == pytest.approx(direct[2] + shift)


def test_asynchronous_output_delivers_every_token_one_step_of_its_request_later():
    # vLLM V0's async output processor returns a step's tokens when the instance's next step ends: TTFT
    # grows by one decode step; the last token, with nothing more to run, is flushed at once
    workload = WorkloadConfig(num_prompts=20, input_len=1024, output_len=20, request_rate=0.05)
    profile = CalibrationProfile("t", {})
    fields = _fields(disaggregate=None, num_gpus=1)
    metrics = ("mean_ttft_ms", "mean_tpot_ms", "mean_e2el_ms")
    direct = [simulate_target(Target(m, "t", fields, workload, m, 1.0), profile) for m in metrics]
    late = [simulate_target(Target(m, "t", replace(fields, async_output=True), workload, m, 1.0), profile)
            for m in metrics]
    shift = late[0] - direct[0]
    assert shift == pytest.approx(direct[1], rel=0.05)  # one decode step (alone on the GPU at 0.05 qps)
    assert late[2] == pytest.approx(direct[2])
    assert late[1] == pytest.approx(direct[1] - shift / 19)
    # a request with one output token has no next step: it is delivered at once
    one = replace(workload, output_len=1)
    assert (simulate_target(Target("t", "t", replace(fields, async_output=True), one, "mean_ttft_ms", 1.0), profile)
            == simulate_target(Target("t", "t", fields, one, "mean_ttft_ms", 1.0), profile))


def test_simulations_are_memoised_by_the_constants_the_target_reads():
    workload = WorkloadConfig(num_prompts=10, input_len=200, output_len=10, request_rate=1.0)
    target = Target("m", "t", _fields(disaggregate=None, num_gpus=1), workload, "median_tpot_ms", 1.0)
    first = simulate_target(target, CalibrationProfile("a", {"engines.vllm.step_overhead_s": 1e-3}))
    size = len(target_simulation._CACHE)
    # another engine's constant and another GPU's do not change what this target resolves to: no new run
    other = CalibrationProfile("b", {"engines.vllm.step_overhead_s": 1e-3, "engines.sglang.step_overhead_s": 5e-3,
                                     "gpus.h100.matmul": 0.3})
    assert simulate_target(target, other) == first and len(target_simulation._CACHE) == size
    slower = simulate_target(target, CalibrationProfile("c", {"engines.vllm.step_overhead_s": 5e-3}))
    assert slower > first and len(target_simulation._CACHE) == size + 1


def test_requests_are_capped_only_where_the_metric_stands_still():
    profile = CalibrationProfile("t", {})
    fields = _fields(model="llama-3.1-8b", gpu="h100", disaggregate=None, num_gpus=1)
    steady = Target("tpot", "t", fields, WorkloadConfig(num_prompts=400, input_len=200, output_len=50,
                                                        request_rate=1.0), "median_tpot_ms", 1.0)
    assert stable_cap(steady, profile, 50) in (50, 100, 200)
    # an overloaded server: each capped run ends sooner, so its throughput is lower; only all requests tell
    overload = Target("rps", "t", fields, WorkloadConfig(dataset="sharegpt-llama3", num_prompts=800,
                                                         request_rate=1000.0), "request_throughput", 1.0)
    assert stable_cap(overload, profile, 50) is None
    at_once = replace(overload, workload=replace(overload.workload, request_rate=math.inf))
    assert stable_cap(at_once, profile, 50) is None


def test_prefill_steps_of_their_own_stall_decodes_more_as_arrivals_grow():
    # vLLM V0 without chunked prefill (and SGLang without mixed chunks) prefills in steps of its own: each
    # arrival stalls every running decode for a whole step, weight read included, instead of adding its
    # chunk's compute to a decode step
    from servelab.lab.api import DeploymentRequest, SimulateRequest, simulate

    def tpot(rate: float, mixed: bool) -> float:
        workload = WorkloadConfig(num_prompts=120, input_len=200, output_len=100, request_rate=rate)
        deployment = DeploymentRequest(model="llama-3.1-8b", gpu="h100", mixed_batches=mixed)
        return simulate(SimulateRequest(deployment, workload)).evaluation.metrics["median_tpot_ms"]

    low, high = (tpot(rate, False) / tpot(rate, True) for rate in (2.0, 16.0))
    assert 1 < low < high
