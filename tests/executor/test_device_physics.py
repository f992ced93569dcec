"""The cost model's device physics, each piece alone: precision (fp8/fp4 GEMM rates, fp8 KV cache),
STREAM-like memory ceilings, the GEMM ramp's roofline cap, and attention at long contexts."""
from dataclasses import replace

import pytest

from servelab.executor.cost_model import CostModel
from servelab.executor.efficiency import GPU_EFFICIENCY
from servelab.lab.catalog import get_device, get_model
from servelab.lab.sim.deployment import Deployment, plan_memory

LLAMA_8B = get_model("llama-3.1-8b")
# no ramp, no overheads: a step's weights part is max(FLOPs / peak share, bytes / bandwidth share)
FLAT = replace(GPU_EFFICIENCY, matmul_half_tokens=0.0, attention_half_tokens=0.0)


def prefill_weights(dtype: str, gpu: str, num_tokens: int = 8192) -> float:
    """The decoder GEMMs' time of a prefill step (less the bf16 rows between them)."""
    cm = CostModel(LLAMA_8B, get_device(gpu), FLAT, dtype=dtype)
    return cm.weights_time(num_tokens, 0) - cm.num_layers * num_tokens * cm.elementwise_bytes_per_token / cm.bandwidth


def test_fp8_gemms_run_at_twice_bf16s_rate_where_the_chip_has_fp8_units():
    for gpu in ("h100", "h200", "h800", "l40s", "mi300x", "mi325x", "b200"):
        d = get_device(gpu)
        assert d.fp8_flops == pytest.approx(2 * d.flops, rel=0.03), gpu  # the datasheets' ratio
        # a compute-bound prefill's GEMMs take the datasheet's ratio less time
        assert prefill_weights("fp8", gpu) == pytest.approx(prefill_weights("bfloat16", gpu) * d.flops / d.fp8_flops,
                                                            rel=0.001), gpu
    # Ampere has no fp8 tensor cores: an fp8 checkpoint dequantizes to bf16 (Marlin W8A16), GEMMs at bf16 speed
    assert prefill_weights("fp8", "a100-80gb") == pytest.approx(prefill_weights("bfloat16", "a100-80gb"), rel=0.01)


def test_fp4_runs_at_twice_fp8_on_blackwell_and_at_bf16_speed_elsewhere():
    assert prefill_weights("fp4", "b200") == pytest.approx(prefill_weights("fp8", "b200") / 2, rel=0.001)
    assert prefill_weights("fp4", "h100") == pytest.approx(prefill_weights("bfloat16", "h100"), rel=0.01)


def test_low_precision_halves_the_weight_stream_but_not_the_lm_head_or_activations():
    h100 = get_device("h100")
    bf16, fp8 = (CostModel(LLAMA_8B, h100, FLAT, dtype=d) for d in ("bfloat16", "fp8"))
    assert fp8.layer_weight_bytes == 1 and bf16.layer_weight_bytes == 2
    assert fp8.dtype_bytes == 2  # the LM head stays bf16
    assert fp8.hidden_bytes_per_token == bf16.hidden_bytes_per_token  # all-reduces move bf16 activations
    # a batch-1 decode step streams the weights: the fp8 layers in about half the time
    assert fp8.weights_time(1, 0) == pytest.approx(bf16.weights_time(1, 0) / 2, rel=0.01)
    # on disk and in memory: decoder matmuls in fp8, embeddings and LM head in bf16
    assert LLAMA_8B.weight_bytes("fp8") == pytest.approx(LLAMA_8B.weight_bytes("bfloat16") / 2
                                                         + LLAMA_8B.lm_head_params * 2, rel=0.001)


def test_an_fp8_kv_cache_halves_kv_bytes_and_doubles_the_blocks():
    h100 = get_device("h100")
    auto, fp8 = (CostModel(LLAMA_8B, h100, FLAT, dtype="fp8", kv_cache_dtype=k) for k in ("auto", "fp8"))
    assert auto.kv_bytes_per_token_layer == 2 * fp8.kv_bytes_per_token_layer  # auto: the activations' bf16
    # FlashAttention-3's fp8 path: attention FLOPs at the fp8 rate when the cache is fp8
    assert fp8.attention_flops == pytest.approx(2 * auto.attention_flops, rel=0.01)
    plans = [plan_memory(Deployment(LLAMA_8B, h100, 1, dtype="fp8", kv_cache_dtype=k), 4096) for k in ("auto", "fp8")]
    assert plans[1].num_blocks == pytest.approx(2 * plans[0].num_blocks, rel=0.01)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        Deployment(LLAMA_8B, h100, 1, kv_cache_dtype="int3")


def test_no_kernel_streams_faster_than_a_stream_like_copy():
    h100 = get_device("h100")
    assert 0.8 <= h100.memory_ceiling < 1
    greedy = replace(FLAT, memory=1.0, kv_memory=1.0)
    cm = CostModel(LLAMA_8B, h100, greedy)
    assert cm.bandwidth == cm.kv_bandwidth == pytest.approx(h100.memory_bandwidth * h100.memory_ceiling)
    modest = CostModel(LLAMA_8B, h100, replace(FLAT, memory=0.6))
    assert modest.bandwidth == pytest.approx(h100.memory_bandwidth * 0.6)  # below the ceiling: as fitted


def test_the_gemm_ramp_never_charges_a_batch_one_step_more_than_the_weight_stream():
    # MI300X's 304 CUs scale a fitted half of 250 rows (per 132 SMs) to ~576: uncapped, a batch-1 step of the
    # 405B model would be charged ~576 rows of compute, far above its weight stream
    mi300x, model = get_device("mi300x"), get_model("llama-3.1-405b")
    e = replace(GPU_EFFICIENCY, matmul=0.6, memory=0.8, matmul_half_tokens=250.0)
    cm = CostModel(model, mi300x, e, tensor_parallel_size=8)
    params = cm.dense_params + cm.expert_params
    stream = params * cm.layer_weight_bytes / cm.bandwidth
    compute = 2 * (1 + cm.matmul_half_tokens) * params / cm.flops
    assert cm.matmul_half_tokens < 250 * 304 / 132
    assert compute == pytest.approx(stream, rel=0.01)  # at the ridge: the ramp ends where the stream does
    # a chip whose fitted half sits below its ridge keeps it
    h100 = CostModel(LLAMA_8B, get_device("h100"), replace(e, matmul_half_tokens=60.0))
    assert h100.matmul_half_tokens == pytest.approx(60.0)


@pytest.mark.parametrize("context", [8192, 32768, 131072])
def test_long_context_attention_is_quadratic_in_prefill_and_linear_in_decode(context):
    cm = CostModel(LLAMA_8B, get_device("h100"), FLAT)
    # a whole prompt of `context` tokens in one step: causal pairs n(n+1)/2, compute-bound
    pairs = context * (context + 1) // 2
    prefill = cm.attention_time(pairs, 2 * context, context)
    assert prefill == pytest.approx(cm.num_layers * cm.score_flops_per_pair * pairs / cm.attention_flops)
    # one decode token against the context: split-KV kernels (flash-decoding) spread it over the chip, so it
    # streams the KV at the paged-read bandwidth
    decode = cm.attention_time(context, context + 1, 1)
    assert decode == pytest.approx(cm.num_layers * cm.kv_bytes_per_token_layer * (context + 1) / cm.kv_bandwidth)
    double = CostModel(LLAMA_8B, get_device("h100"), FLAT)
    assert double.attention_time(4 * pairs, 4 * context, 2 * context) == pytest.approx(4 * prefill, rel=0.01)
