"""ModelSpec: one parser of a Hugging Face config.json for the engine and the lab. Real config.json files
(as published on the Hub) give exact parameter counts, checked against transformers' own model built on
the meta device, KV bytes with GQA and tensor parallelism, and MoE active versus total parameters."""
import json

import pytest
import torch

from servelab.lab.catalog import get_model
from servelab.model.loader import load_model_config
from servelab.specs import ModelSpec, hf_architecture

LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0, "bos_token_id": 128000,
    "eos_token_id": [128001, 128008, 128009], "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
    "intermediate_size": 14336, "max_position_embeddings": 131072, "mlp_bias": False, "model_type": "llama",
    "num_attention_heads": 32, "num_hidden_layers": 32, "num_key_value_heads": 8, "pretraining_tp": 1,
    "rms_norm_eps": 1e-05, "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                            "original_max_position_embeddings": 8192, "rope_type": "llama3"},
    "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "vocab_size": 128256,
}
QWEN2_5_7B = {
    "architectures": ["Qwen2ForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645,
    "hidden_act": "silu", "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 18944,
    "max_position_embeddings": 32768, "max_window_layers": 28, "model_type": "qwen2", "num_attention_heads": 28,
    "num_hidden_layers": 28, "num_key_value_heads": 4, "rms_norm_eps": 1e-06, "rope_theta": 1000000.0,
    "sliding_window": 131072, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 152064,
}
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "attention_dropout": 0.0, "bos_token_id": 1, "eos_token_id": 2,
    "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02, "intermediate_size": 14336,
    "max_position_embeddings": 32768, "model_type": "mixtral", "num_attention_heads": 32, "num_experts_per_tok": 2,
    "num_hidden_layers": 32, "num_key_value_heads": 8, "num_local_experts": 8, "output_router_logits": False,
    "rms_norm_eps": 1e-05, "rope_theta": 1000000.0, "router_aux_loss_coef": 0.02, "sliding_window": None,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 32000,
}
# (config, parameters, KV bytes per token in bf16 on one device)
REAL_CONFIGS = {
    "llama-3.1-8b": (LLAMA_3_1_8B, 8_030_261_248, 2 * 32 * 8 * 128 * 2),
    "qwen2.5-7b": (QWEN2_5_7B, 7_615_616_512, 2 * 28 * 4 * 128 * 2),
    "mixtral-8x7b": (MIXTRAL_8X7B, 46_702_792_704, 2 * 32 * 8 * 128 * 2),
}


def write_config(folder, cfg: dict):
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("name", sorted(REAL_CONFIGS))
def test_real_config_json_sizes_match_transformers(name, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg, num_params, kv_bytes = REAL_CONFIGS[name]
    spec = get_model(str(write_config(tmp_path, cfg)))
    assert (spec.num_params, spec.weight_bytes("bfloat16"), spec.kv_bytes_per_token("bfloat16")) == (
        num_params, 2 * num_params, kv_bytes)
    with torch.device("meta"):  # shapes only, no memory
        reference = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tmp_path))
    assert spec.num_params == sum(p.numel() for p in reference.parameters())


def test_every_field_the_engine_and_the_lab_read(tmp_path):
    llama = ModelSpec.from_hf_config(LLAMA_3_1_8B, id="llama")
    assert (llama.architecture, llama.hidden_size, llama.intermediate_size, llama.num_hidden_layers) == (
        "LlamaForCausalLM", 4096, 14336, 32)
    assert (llama.num_attention_heads, llama.num_key_value_heads, llama.head_dim, llama.vocab_size) == (
        32, 8, 128, 128256)
    assert (llama.max_position_embeddings, llama.rms_norm_eps, llama.rope_theta) == (131072, 1e-5, 500000.0)
    assert dict(llama.rope_scaling) == LLAMA_3_1_8B["rope_scaling"]
    assert (llama.tie_word_embeddings, llama.attention_bias, llama.bos_token_id, llama.eos_token_ids) == (
        False, False, 128000, (128001, 128008, 128009))
    assert (llama.num_experts, llama.num_experts_per_tok) == (1, 1)
    qwen = ModelSpec.from_hf_config(QWEN2_5_7B, id="qwen")
    # Qwen2's config.json does not say so, but its q/k/v projections carry a bias
    assert qwen.attention_bias and qwen.rope_scaling is None and qwen.eos_token_ids == (151645,)
    assert qwen.attention_params_per_layer == 3584 * (3584 + 2 * 512) + 3584 * 3584 + (3584 + 2 * 512)
    # model_type alone names the architecture (older config.json files)
    no_archs = {k: v for k, v in MIXTRAL_8X7B.items() if k != "architectures"}
    assert hf_architecture(no_archs) == "MixtralForCausalLM"
    with pytest.raises(ValueError, match="names no architecture"):
        ModelSpec.from_hf_config({k: v for k, v in no_archs.items() if k != "model_type"}, id="bare")


def test_moe_active_versus_total():
    m = ModelSpec.from_hf_config(MIXTRAL_8X7B, id="mixtral")
    assert (m.num_experts, m.num_experts_per_tok) == (8, 2)
    layer_attention, expert, router = 41_943_040, 3 * 4096 * 14336, 4096 * 8
    assert (m.attention_params_per_layer, m.expert_params, m.router_params_per_layer) == (
        layer_attention, expert, router)
    assert m.num_params == 32 * (layer_attention + 8 * expert + router + 2 * 4096) + 2 * 32000 * 4096 + 4096
    assert m.num_active_params == 32 * (layer_attention + 2 * expert + router + 2 * 4096) + 2 * 32000 * 4096 + 4096
    assert m.num_active_params == 12_879_925_248
    # two experts' FLOPs per token, not eight: 2 FLOPs per weight of the layers and the LM head
    assert m.flops_per_token == 2 * (32 * (layer_attention + 2 * expert + router) + 32000 * 4096) == 25_497_174_016
    dense = ModelSpec.from_hf_config(LLAMA_3_1_8B, id="llama")
    assert dense.num_active_params == dense.num_params


def test_kv_bytes_with_gqa_and_tensor_parallelism():
    llama = ModelSpec.from_hf_config(LLAMA_3_1_8B, id="llama")  # 8 KV heads of 128, 32 layers
    per_head = 2 * 32 * 128 * 2  # K and V, every layer, bf16
    assert [llama.kv_bytes_per_token("bfloat16", tp) for tp in (1, 2, 4, 8)] == [8 * per_head, 4 * per_head,
                                                                                 2 * per_head, per_head]
    # more ranks than KV heads: each rank keeps a replica of one head, as vLLM does
    assert llama.kv_bytes_per_token("bfloat16", 16) == llama.kv_bytes_per_token("bfloat16", 32) == per_head
    assert llama.num_kv_heads_per_rank(16) == 1
    assert llama.kv_bytes_per_token("fp8") == 8 * per_head // 2 and llama.kv_bytes_per_token("float32") == 16 * per_head
    assert llama.layer_kv_bytes_per_token("bfloat16", 2) * 32 == llama.kv_bytes_per_token("bfloat16", 2)
    with pytest.raises(ValueError, match="neither divides nor is a multiple"):
        llama.kv_bytes_per_token("bfloat16", 3)
    smol = get_model("smollm2-135m")  # 3 KV heads of 64, 30 layers
    assert smol.kv_bytes_per_token("bfloat16", 3) == smol.kv_bytes_per_token("bfloat16", 9) == 2 * 30 * 64 * 2
    assert smol.layer_score_flops_per_pair(3) == 4 * 3 * 64
    with pytest.raises(ValueError, match="does not divide"):
        smol.layer_score_flops_per_pair(2)


def test_the_engine_runs_llama_and_qwen2_and_the_lab_also_prices_mixtral(tmp_path):
    for name in ("llama-3.1-8b", "qwen2.5-7b"):
        folder = write_config(tmp_path / name, REAL_CONFIGS[name][0])
        engine_spec = load_model_config(folder)
        assert engine_spec == get_model(str(folder))  # one parser: the same spec, field for field
    folder = write_config(tmp_path / "mixtral", MIXTRAL_8X7B)
    with pytest.raises(ValueError, match="unsupported model architecture 'MixtralForCausalLM'"):
        load_model_config(folder)
    assert get_model(str(folder)).num_experts == 8


def test_smollm2_parameters_are_the_converted_gguf_tensors(default_model_dir):
    """134,515,008 with tied embeddings: the element count of every tensor the GGUF converts to."""
    from safetensors import safe_open

    spec = load_model_config(default_model_dir)
    with safe_open(str(default_model_dir / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
        numel = sum(torch.Size(f.get_slice(n).get_shape()).numel() for n in names)
    assert "lm_head.weight" not in names and spec.tie_word_embeddings
    assert spec.num_params == numel == 134_515_008
    assert get_model("smollm2-135m").num_params == spec.num_params
