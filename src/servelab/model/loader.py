"""Find a model folder (converting a GGUF once into a cache), read its config and weights."""
from __future__ import annotations

import json
from pathlib import Path

import torch

from servelab.model.model_path import (DEFAULT_MODEL, DEFAULT_MODEL_ALIASES, cache_root,  # noqa: F401 (re-exported)
                                       converted_gguf_dir, default_gguf_path, resolve_model_path)
from servelab.specs import ModelSpec, hf_architecture

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What model/llama.py runs; the lab's ModelSpec also reads others (Mixtral, ...) to price them.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def load_model_config(folder: Path) -> ModelSpec:
    """The ModelSpec of folder/config.json, for a model the engine can run."""
    folder = Path(folder)
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read model config {path}: {e}") from e
    try:
        arch = hf_architecture(cfg)
        if arch not in SUPPORTED_ARCHITECTURES:  # before the fields: an unsupported model says so, not what it lacks
            raise ValueError(f"unsupported model architecture {arch!r}; "
                             f"servelab runs {', '.join(SUPPORTED_ARCHITECTURES)}")
        return ModelSpec.from_hf_config(cfg, id=str(folder), name=folder.name, source=str(path))
    except (TypeError, ValueError) as e:
        raise ValueError(f"{path}: {e}") from e


def load_state_dict(folder: Path, dtype: torch.dtype, skip=None) -> dict[str, torch.Tensor | None]:
    """Every tensor of every *.safetensors file in `folder`, cast to `dtype`, under its file name; None (not
    read) for the names skip(name) is true for.

    Nothing is added: with tied embeddings there is usually no lm_head.weight, and the model must
    use model.embed_tokens.weight.
    """
    from safetensors import safe_open

    files = sorted(Path(folder).glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    state_dict: dict[str, torch.Tensor] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                if name in state_dict:
                    raise ValueError(f"tensor {name!r} appears in more than one file in {folder}")
                state_dict[name] = None if skip is not None and skip(name) else f.get_tensor(name).to(dtype)
    return state_dict


def _cpu_has_fast_bf16() -> bool:
    for probe in ("_is_amx_tile_supported", "_is_avx512_bf16_supported"):
        fn = getattr(torch.cpu, probe, None)
        if fn is not None and fn():
            return True
    return False


def resolve_dtype(name: str) -> torch.dtype:
    """'auto' is bfloat16 where it is fast on this CPU: native bf16 (AVX512-BF16 / AMX) or servelab's
    AVX2 kernels (bf16 storage, fp32 math); else float32."""
    if name == "auto":
        from servelab.kernels import cpu_ops

        return torch.bfloat16 if _cpu_has_fast_bf16() or cpu_ops() is not None else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}; choose one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]
