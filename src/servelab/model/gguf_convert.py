"""Convert a llama-architecture GGUF file into a Hugging Face style folder (float32 safetensors)."""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np

from servelab.specs import ModelSpec

# Bump when the output changes, so caches keyed on it are rebuilt.
CONVERTER_VERSION = 1

_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")

_CONTROL, _USER_DEFINED = 3, 4
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_LLAMA3_PRE = ("llama3", "llama-v3", "llama-bpe")
_ARCH = "llama"


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    m = _LAYER_RE.fullmatch(gguf_name)
    if m is None or m.group(2) not in _LAYER_TENSORS:
        raise ValueError(f"GGUF tensor {gguf_name!r} has no Llama equivalent; this converter cannot handle it")
    return f"model.layers.{m.group(1)}.{_LAYER_TENSORS[m.group(2)]}.{m.group(3)}"


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo convert_hf_to_gguf.py's `permute`, which interleaves each head's two rotary halves.

    llama.cpp stores rows of a head as (dim/2, 2) pairs for its GPT-J style rope; HF keeps (2, dim/2).
    `num_heads` is the head count of this projection (the KV head count for k_proj).
    """
    head_dim_half = weight.shape[0] // num_heads // 2
    w = weight.reshape(num_heads, head_dim_half, 2, *weight.shape[1:])
    return np.ascontiguousarray(w.swapaxes(1, 2).reshape(weight.shape))


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _round_f32(value: float) -> float:
    """GGUF stores floats as float32; 9.99999974e-06 reads back as the 1e-05 the model was trained with."""
    return float(str(np.float32(value)))


def _convert_tensors(reader, num_heads: int, num_kv_heads: int) -> dict[str, np.ndarray]:
    from gguf.quants import dequantize

    tensors = {}
    for t in reader.tensors:
        name = hf_tensor_name(t.name)
        weight = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if ".q_proj." in name:
            weight = unpermute_qk(weight, num_heads)
        elif ".k_proj." in name:
            weight = unpermute_qk(weight, num_kv_heads)
        tensors[name] = np.ascontiguousarray(weight)
    return tensors


def _hf_config(reader, tensors: dict[str, np.ndarray]) -> dict:
    arch = _ARCH
    hidden = int(_field(reader, f"{arch}.embedding_length"))
    heads = int(_field(reader, f"{arch}.attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // heads))
    rope_dim = _field(reader, f"{arch}.rope.dimension_count")
    if rope_dim is not None and int(rope_dim) != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} < head dim {head_dim}) are not supported")
    scaling = _field(reader, f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported by the converter")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": int(tensors["model.embed_tokens.weight"].shape[0]),
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(_field(reader, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "max_position_embeddings": int(_field(reader, f"{arch}.context_length", 2048)),
        "rms_norm_eps": _round_f32(_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _round_f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": None,
        "hidden_act": "silu",
        "attention_bias": "model.layers.0.self_attn.q_proj.bias" in tensors,
        "mlp_bias": False,
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": eos_id,
        "torch_dtype": "float32",
    }


def _pre_tokenizer(pre: str):
    from tokenizers import Regex, pre_tokenizers

    if pre in _LLAMA3_PRE:
        return pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=False),
        ])
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    if pre == "smollm":
        # llama.cpp splits every digit on its own before the GPT-2 regex, as SmolLM2's tokenizer.json does.
        return pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
    if pre in ("default", "gpt2", "gpt-2", ""):
        return byte_level
    raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported (known: smollm, gpt2, {', '.join(_LLAMA3_PRE)})")


def _write_tokenizer(reader, out: Path, config: dict) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, processors

    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported; only byte-level BPE ('gpt2') is")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    token_types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges", [])]
    pre = _field(reader, "tokenizer.ggml.pre", "default")

    vocab = {tok: i for i, tok in enumerate(tokens)}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False,
                                     ignore_merges=pre in _LLAMA3_PRE))
    tokenizer.pre_tokenizer = _pre_tokenizer(pre)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(tok, special=True, normalized=False)
                                  for tok, kind in zip(tokens, token_types) if kind == _CONTROL])
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False)
                          for tok, kind in zip(tokens, token_types) if kind == _USER_DEFINED])

    def token(key: str) -> str | None:
        idx = _field(reader, f"tokenizer.ggml.{key}")
        return tokens[idx] if idx is not None and 0 <= idx < len(tokens) else None

    add_bos = bool(_field(reader, "tokenizer.ggml.add_bos_token", False)) and token("bos_token_id") is not None
    add_eos = bool(_field(reader, "tokenizer.ggml.add_eos_token", False)) and token("eos_token_id") is not None
    byte_level = processors.ByteLevel(trim_offsets=False)
    if add_bos or add_eos:
        # transformers 5 ignores tokenizer_config's add_bos_token when tokenizer.json exists: BOS must live here.
        bos, eos = token("bos_token_id"), token("eos_token_id")
        single = f"{bos + ':0 ' if add_bos else ''}$A:0{' ' + eos + ':0' if add_eos else ''}"
        pair = f"{single}{' ' + bos + ':1' if add_bos else ''} $B:1{' ' + eos + ':1' if add_eos else ''}"
        specials = [(t, vocab[t]) for t, on in ((bos, add_bos), (eos, add_eos)) if on]
        bos_eos = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        tokenizer.post_processor = processors.Sequence([byte_level, bos_eos])
    else:
        tokenizer.post_processor = byte_level
    tokenizer.save(str(out / "tokenizer.json"))

    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token("bos_token_id"),
        "eos_token": token("eos_token_id"),
        "unk_token": token("unknown_token_id"),
        "pad_token": token("padding_token_id"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": config["max_position_embeddings"],
    }
    if (chat_template := _field(reader, "tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = chat_template
    _write_json(out / "tokenizer_config.json", tokenizer_config)

    eos_ids = [_field(reader, f"tokenizer.ggml.{key}") for key in ("eos_token_id", "eot_token_id", "eom_token_id")]
    eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
    generation_config = {"bos_token_id": config["bos_token_id"],
                         "eos_token_id": eos_ids[0] if len(eos_ids) == 1 else eos_ids}
    if (pad := _field(reader, "tokenizer.ggml.padding_token_id")) is not None:
        generation_config["pad_token_id"] = pad
    _write_json(out / "generation_config.json", generation_config)


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write config.json, model.safetensors (float32) and tokenizer files for `gguf_path` into `out_dir`.

    Everything is written into a temporary sibling folder that is renamed into place at the end, so
    `out_dir` either does not exist or is complete. If another process finishes the same folder
    first, its result is kept and returned.
    """
    from gguf import GGUFReader
    from safetensors.numpy import save_file

    gguf_path, out_dir = Path(gguf_path), Path(out_dir)
    if out_dir.exists():
        raise ValueError(f"conversion target {out_dir} already exists")
    reader = GGUFReader(gguf_path)
    arch = _field(reader, "general.architecture")
    if arch != _ARCH:
        raise ValueError(f"{gguf_path}: GGUF architecture {arch!r} is not supported; only {_ARCH!r} is")
    heads = int(_field(reader, f"{_ARCH}.attention.head_count"))
    kv_heads = int(_field(reader, f"{_ARCH}.attention.head_count_kv", heads))

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.parent / f".{out_dir.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()
    try:
        tensors = _convert_tensors(reader, heads, kv_heads)
        config = _hf_config(reader, tensors)
        ModelSpec.from_hf_config(config, id=str(gguf_path))  # fails here, before writing, on a bad config
        _write_tokenizer(reader, tmp, config)
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del tensors
        _write_json(tmp / "config.json", config)
        # safetensors creates its file 0600; give it the umask-derived mode of the others.
        os.chmod(tmp / "model.safetensors", (tmp / "config.json").stat().st_mode)
        try:
            os.rename(tmp, out_dir)
        except OSError:
            if not (out_dir / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir
