"""Cost model arithmetic against hand-computed cases, and the memory plan."""
from dataclasses import replace

import pytest

from servelab.core.plan import ScheduledRequest, StepPlan
from servelab.executor.cost_model import CostModel
from servelab.executor.efficiency import Efficiency
from servelab.executor.cost_model_executor import CostModelExecutor
from servelab.lab.catalog import get_device, get_model
from servelab.specs import DeviceSpec, ModelSpec
from servelab.lab.sim.deployment import Deployment, plan_memory
from servelab.lab.sim.simulate import simulate
from servelab.workload import SampledRequest
from servelab.sampling_params import SamplingParams

# Round numbers: 10 layers, hidden 1024, 16 heads / 4 KV heads of 64, MLP 4096, vocab 32000.
TOY = ModelSpec(id="toy", name="toy", architecture="LlamaForCausalLM", hidden_size=1024, intermediate_size=4096,
                num_hidden_layers=10, num_attention_heads=16, num_key_value_heads=4, head_dim=64, vocab_size=32000,
                max_position_embeddings=4096, tie_word_embeddings=False, attention_bias=False, num_experts=1,
                num_experts_per_tok=1, source="")
DEVICE = DeviceSpec(id="dev", name="dev", flops=100e12, memory_bandwidth=1e12, memory_bytes=16 << 30,
                    interconnect="link", interconnect_bandwidth=200e9, network_bandwidth=10e9, gpus_per_node=8,
                    source="")
IDEAL = Efficiency(matmul=1, attention=1, memory=1, kv_memory=1, interconnect=1, allreduce_latency_s=0,
                   step_overhead_s=0, request_overhead_s=0)
PARAMS = SamplingParams()


def uncapped(gpu: str) -> DeviceSpec:
    """The catalog GPU without its STREAM-like ceiling, so IDEAL streams at the datasheet's peak."""
    return replace(get_device(gpu), memory_ceiling=None)
# HBM bytes per token and layer of the kernels between the GEMMs: two fused add + RMS norms (read hidden and
# residual, write both: 8 x 1024), rotary in place on q and k (2 x (1024 + 256)), SiLU-and-mul (read gate and
# up, write one: 3 x 4096), bf16
ELEMENTWISE = (8 * 1024 + 2 * (1024 + 256) + 3 * 4096) * 2


def decode_plan(*contexts):
    return StepPlan([ScheduledRequest(str(i), [0], c - 1, [], True, PARAMS) for i, c in enumerate(contexts)])


def test_toy_model_sizes():
    # per layer: q,k,v,o = 1024*(1024+256+256) + 1024*1024; MLP 3*1024*4096; two norms
    per_layer = 1024 * 1536 + 1024 * 1024 + 3 * 1024 * 4096 + 2 * 1024
    assert TOY.num_params == 10 * per_layer + 2 * 32000 * 1024 + 1024 == 217_601_024
    assert TOY.kv_bytes_per_token("bfloat16") == 2 * 10 * 4 * 64 * 2 == 10240


def test_decode_step_by_hand():
    result = CostModelExecutor(CostModel(TOY, DEVICE, IDEAL)).execute(decode_plan(100))
    layer_weight_bytes = (1024 * 1536 + 1024 * 1024 + 3 * 1024 * 4096) * 2
    # memory-bound GEMV + the norms', rotary's and gated activation's row + LM head
    weights = 10 * (layer_weight_bytes / 1e12 + ELEMENTWISE / 1e12) + 32000 * 1024 * 2 / 1e12
    # one query over 100 keys: 4*16*64*100 FLOPs is far below reading 101 KV entries of 2*4*64*2 bytes
    attention = 10 * (101 * 1024 / 1e12)
    assert result.breakdown["weights"] == pytest.approx(weights, rel=1e-12)
    assert result.breakdown["attention"] == pytest.approx(attention, rel=1e-12)
    assert result.breakdown["communication"] == 0 and result.duration == pytest.approx(weights + attention)
    assert list(result.sampled) == ["0"]


def test_prefill_is_compute_bound_and_quadratic():
    cm = CostModel(TOY, DEVICE, IDEAL)
    plan = StepPlan([ScheduledRequest("a", [0] * 4000, 0, [], True, PARAMS)])
    parts = CostModelExecutor(cm).execute(plan).breakdown
    layer_flops = 2 * 4000 * (1024 * 1536 + 1024 * 1024 + 3 * 1024 * 4096)
    assert parts["weights"] == pytest.approx(10 * (layer_flops / 100e12 + 4000 * ELEMENTWISE / 1e12)
                                             + 2 * 32000 * 1024 / 1e12)
    pairs = 4000 * 4000 - 4000 * 3999 // 2  # causal
    assert parts["attention"] == pytest.approx(10 * 4 * 16 * 64 * pairs / 100e12)


def test_tensor_parallel_split_and_alpha_beta_all_reduce():
    one, two = CostModel(TOY, DEVICE, IDEAL, 1), CostModel(TOY, DEVICE, IDEAL, 2)
    # every rank runs the norms on the whole hidden state (8 x 1024 bf16 of a token's row per layer)
    assert two.weights_time(1, 1) == pytest.approx(one.weights_time(1, 1) / 2 + 10 * 4 * 1024 * 2 / 1e12)
    assert two.kv_bytes_per_token_layer == one.kv_bytes_per_token_layer // 2  # KV heads split
    # two all-reduces per layer; ring: 2(tp-1) steps of bytes/tp over 100 GB/s each way
    message = 8 * 1024 * 2
    assert two.communication_time(8) == pytest.approx(10 * 2 * (2 * 1 * (message / 2 / 100e9)))
    latency = Efficiency(**{**IDEAL.__dict__, "allreduce_latency_s": 1e-6})
    four = CostModel(TOY, DEVICE, latency, 4)
    # alpha-beta: one latency per all-reduce call, not per ring step
    assert four.communication_time(8) == pytest.approx(10 * 2 * (1e-6 + 2 * 3 * message / 4 / 100e9))


def test_moe_reads_only_touched_experts():
    mixtral = get_model("mixtral-8x7b")
    cm = CostModel(mixtral, uncapped("h100"), IDEAL)
    one, many = cm.weights_time(1, 0), cm.weights_time(512, 0)
    expert_bytes = mixtral.expert_params * 2 / 3350e9 * mixtral.num_hidden_layers
    dense_bytes = (mixtral.attention_params_per_layer + mixtral.router_params_per_layer) * 2 / 3350e9 * 32
    rows = mixtral.layer_elementwise_bytes_per_token("bfloat16") / 3350e9 * 32  # its row between the GEMMs
    assert one == pytest.approx(dense_bytes + 2 * expert_bytes + rows)  # one token touches 2 of 8 experts
    assert many > dense_bytes + 7.9 * expert_bytes


SLOW_FLOPS = DeviceSpec(**{**DEVICE.__dict__, "flops": 2e9})  # attention compute-bound even when decoding


@pytest.mark.parametrize("model, device, tp", [(get_model("llama-3.1-70b"), uncapped("h100"), 4),
                                               (TOY, SLOW_FLOPS, 1), (TOY, DEVICE, 2)])
def test_decode_runs_priced_exactly_like_single_plans(model, device, tp):
    cm = CostModel(model, device, IDEAL, tp)
    durations = cm.decode_step_times(3, 300 + 301 + 302, 40)
    for j, duration in enumerate(durations):
        plan = decode_plan(300 + j, 301 + j, 302 + j)
        assert duration == CostModelExecutor(cm).execute(plan).duration  # bit-identical
    short = cm.decode_step_times(3, 903, 40, within=durations[0] * 5.5)
    assert cm.decode_step_times(3, 903, 100)[:40] == durations  # numpy path, same floats
    assert short == durations[:len(short)] and 6 <= len(short) < 40


@pytest.mark.parametrize("model, device", [(get_model("llama-3.1-8b"), uncapped("h100")), (TOY, SLOW_FLOPS)])
def test_tabulated_decode_steps_are_the_cost_models(model, device):
    cm = CostModel(model, device, IDEAL)
    executor = CostModelExecutor(cm)
    for batch_size in (1, 3, CostModelExecutor.TABULATED_BATCH_SIZE, CostModelExecutor.TABULATED_BATCH_SIZE + 1):
        for context_len_sum in (batch_size, 7 * batch_size + 2, 900 * batch_size + 1):
            for num_steps, within in ((1, float("inf")), (25, float("inf")), (300, float("inf")), (300, 0.05)):
                expected = cm.decode_step_times(batch_size, context_len_sum, num_steps, within)
                assert executor._decode_step_times(batch_size, context_len_sum, num_steps, within) == expected
    longer = CostModelExecutor.TABULATED_STEPS + 5  # past the tables: priced directly
    assert executor._decode_step_times(3, 3, longer, float("inf")) == cm.decode_step_times(3, 3, longer)


def test_step_time_grows_with_batch_and_context():
    cm = CostModel(get_model("llama-3.1-8b"), get_device("h100"), Efficiency(0.7, 0.5, 0.8, 0.7, 0.75, 1e-6, 3e-4, 3e-6))
    assert cm.decode_step_time(1, 100) < cm.decode_step_time(64, 100) < cm.decode_step_time(64, 4000)


def test_memory_plan_by_hand():
    d = Deployment(get_model("llama-3.1-8b"), get_device("h100"), num_gpus=1)
    m = plan_memory(d, 2048)
    usable = int(80 * 2**30 * 0.9)
    activations = 8192 * (2 * 14336 + 4 * 4096) * 2 + 256 * 128256 * 4 + 2**30
    assert (m.weight_bytes, m.usable_bytes, m.activation_bytes) == (8_030_261_248 * 2, usable, activations)
    assert m.num_blocks == (usable - m.weight_bytes - activations) // (131072 * 16) and m.fits
    tp2 = plan_memory(Deployment(get_model("llama-3.1-8b"), get_device("h100"), num_gpus=2, tensor_parallel_size=2), 2048)
    assert tp2.weight_bytes == m.weight_bytes // 2 and tp2.kv_bytes_per_token == 131072 // 2


def test_kv_transfer_time_prompt_over_the_link():
    d = Deployment(get_model("llama-3.1-8b"), get_device("h100"), num_gpus=2, num_prefill_instances=1,
                   num_decode_instances=1)
    result = simulate(d, [SampledRequest(0.0, 1000, 4)])
    # 0.5 ms setup + 1000 tokens x 128 KiB over NVLink (450 GB/s each way) at 80%
    assert result.kv_transfer_times == [pytest.approx(0.5e-3 + 1000 * 131072 / (450e9 * 0.8))]
    r = result.requests[0]
    assert r.num_output_tokens == 4 and r.times.token_times[1] - r.times.token_times[0] > result.kv_transfer_times[0]


def test_elementwise_kernels_stream_every_row_through_memory():
    assert TOY.layer_elementwise_bytes_per_token("bfloat16") == ELEMENTWISE == 46080
    # split by tp but for the norms, which every rank runs on the whole hidden state after the all-reduce
    assert TOY.layer_elementwise_bytes_per_token("bfloat16", 2) == (8 * 1024 + 1024 + 256 + 3 * 2048) * 2
    # Llama-3.1-8B: 172 KB a token and layer, 5.5 MB a token; a vLLM 0.6 prefill step of 17 prompts of 462
    # tokens on an H100 at 80% of its HBM streams 43 GB of them: 16 ms on top of its GEMMs
    llama = get_model("llama-3.1-8b")
    assert llama.layer_elementwise_bytes_per_token("bfloat16") == (8 * 4096 + 2 * (4096 + 1024) + 3 * 14336) * 2
    half = Efficiency(**{**IDEAL.__dict__, "memory": 0.8})
    h100 = get_device("h100")
    with_rows, without = CostModel(llama, h100, half), CostModel(llama, h100, half)
    without.elementwise_bytes_per_token = 0
    extra = with_rows.weights_time(17 * 462, 17) - without.weights_time(17 * 462, 17)
    assert extra == pytest.approx(32 * 17 * 462 * 172032 / (h100.memory_bandwidth * 0.8))
    assert 0.010 < extra < 0.020
    # int4 weights leave the activations in 16 bits
    assert CostModel(llama, h100, half, quantization="gptq-int4").elementwise_bytes_per_token == 172032


def test_a_step_of_requests_whose_kv_arrived_runs_only_the_lm_head():
    # vLLM's KV connector on a decode instance: the prompt's KV and last hidden state came from the prefill
    # instance, so the first step skips every decoder layer (bypass_model_exec) and samples from the LM head
    overheads = Efficiency(**{**IDEAL.__dict__, "step_overhead_s": 1e-3, "request_overhead_s": 1e-5})
    executor = CostModelExecutor(CostModel(TOY, DEVICE, overheads))
    received = [ScheduledRequest(str(i), [7], 300, [], True, PARAMS, prompt_token_ids=[0] * 300,
                                 output_token_ids=[7]) for i in range(2)]
    result = executor.execute(StepPlan(received))
    lm_head = 32000 * 1024 * 2 / 1e12  # two rows: reading the head's weights wins
    assert result.breakdown == {"weights": pytest.approx(lm_head), "attention": 0.0, "communication": 0.0,
                                "overhead": pytest.approx(1e-3 + 2e-5)}
    assert list(result.sampled) == ["0", "1"]
    # the same rows as plain decodes (seen before: no prompt handed in) run every layer
    decodes = executor.execute(decode_plan(301, 301))
    assert decodes.breakdown["weights"] > 5 * lm_head and decodes.breakdown["attention"] > 0
    # a prefix-cache hit still computes its prompt's last token: a normal step
    hit = ScheduledRequest("h", [0], 299, [], True, PARAMS, prompt_token_ids=[0] * 300)
    assert executor.execute(StepPlan([hit])).breakdown["attention"] > 0
    # a step that also decodes others is not bypassed (the connector bypasses whole batches of received prompts)
    mixed = executor.execute(StepPlan(received + decode_plan(301).scheduled))
    assert mixed.breakdown["weights"] > 5 * lm_head
