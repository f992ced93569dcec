"""Catalog entries and the sizes derived from them, against published figures and hand arithmetic."""
import json

import pytest

from servelab.lab.catalog import DATA_DIR, get_device, get_model, gpu_ids, model_ids

PUBLISHED_PARAMS = {  # from the model cards
    "smollm2-135m": 134.5e6, "llama-3.1-8b": 8.03e9, "llama-3.1-70b": 70.6e9, "llama-3.1-405b": 405.9e9,
    "qwen2.5-7b": 7.62e9, "qwen2.5-72b": 72.7e9, "mixtral-8x7b": 46.7e9, "llama-2-7b": 6.74e9,
}


def test_issue_catalog_ids_exist_with_sources():
    assert {"a100-40gb", "a100-80gb", "h100", "h200", "l4", "a10g", "mi300x"} <= set(gpu_ids())
    assert set(PUBLISHED_PARAMS) == set(model_ids())
    for name in ("gpus.json", "models.json"):
        for key, entry in json.loads((DATA_DIR / name).read_text()).items():
            assert key.startswith("_") or entry["source"], f"{key} has no source"


@pytest.mark.parametrize("model_id", sorted(PUBLISHED_PARAMS))
def test_parameter_counts_match_model_cards(model_id):
    assert get_model(model_id).num_params == pytest.approx(PUBLISHED_PARAMS[model_id], rel=0.005)


def test_kv_bytes_per_token_gqa_and_weight_bytes():
    m = get_model("llama-3.1-8b")
    # 2 (K and V) x 32 layers x 8 KV heads x 128 dims x 2 bytes
    assert m.kv_bytes_per_token("bfloat16") == 2 * 32 * 8 * 128 * 2 == 131072
    assert m.kv_bytes_per_token("fp8") == 65536
    assert m.weight_bytes("bfloat16") == 2 * m.num_params
    assert get_model("llama-3.1-70b").kv_bytes_per_token("bfloat16") == 2 * 80 * 8 * 128 * 2


def test_moe_active_versus_total_and_flops_per_token():
    m = get_model("mixtral-8x7b")
    assert m.num_active_params == pytest.approx(12.9e9, rel=0.01)
    dense = get_model("llama-3.1-8b")
    # 2 FLOPs per matmul weight: every layer weight plus the LM head, not the embedding lookup
    assert dense.flops_per_token == 2 * (dense.num_params - dense.vocab_size * dense.hidden_size
                                         - (2 * dense.num_hidden_layers + 1) * dense.hidden_size)


def test_config_json_path_and_bad_ids(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    m = get_model(str(tmp_path))
    assert m.head_dim == 16 and m.kv_bytes_per_token("float32") == 2 * 2 * 2 * 16 * 4
    with pytest.raises(ValueError, match="unknown model"):
        get_model("llama-9")
    with pytest.raises(ValueError, match="unknown GPU 'h900'"):
        get_device("h900")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "hidden_size": 64}))
    with pytest.raises(ValueError, match="lacks the field 'num_attention_heads'"):
        get_model(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 64}))
    with pytest.raises(ValueError, match="names no architecture"):
        get_model(str(tmp_path))


def test_gpu_numbers_are_datasheet_values():
    h100 = get_device("h100")
    assert (h100.flops, h100.memory_bandwidth, h100.memory_bytes) == (989e12, 3350e9, 80 * 2**30)
    assert h100.interconnect_bandwidth_per_direction == 450e9
