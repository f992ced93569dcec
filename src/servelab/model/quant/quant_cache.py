"""--quantization int8's calibration statistics and int8 weights, kept in the cache folder so that a restart loads
them instead of calibrating and quantizing again.

An entry is one safetensors file, `$SERVELAB_CACHE_DIR/quant/int8-<model>-<config>.safetensors`, named by
- the model's content hash: sha256 of its config.json and every *.safetensors file (each file's hash is remembered
  by (path, size, mtime) in hashes.json, so an unchanged file is not read again), and
- the calibration's hash: the calibration text, the SmoothQuant strength, the chunk length, the dtype and
  FORMAT_VERSION (bumped when quantization changes what it computes).
Its metadata repeats both hashes and a sha256 of every tensor's bytes; a file whose hashes or bytes differ is
not used (it is rebuilt and replaced). Files are written to a temporary name and renamed, so a reader never sees a
half-written entry."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import torch

from servelab.model.model_path import cache_root

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
_READ_BYTES = 1 << 22


def cache_folder() -> Path:
    return cache_root().parent / "quant"  # beside models/ in $SERVELAB_CACHE_DIR


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def file_sha256(path: Path) -> str:
    """sha256 of a file's bytes, remembered by (path, size, mtime) so that an unchanged file is hashed once."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}:{stat.st_size}:{stat.st_mtime_ns}"
    index_path = cache_folder() / "hashes.json"
    try:
        index = json.loads(index_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        index = {}
    if key not in index:
        index = {k: v for k, v in index.items() if not k.startswith(f"{path}:")}  # the file's older versions
        index[key] = _file_sha256(path)
        _write_atomically(index_path, json.dumps(index, indent=1).encode())
    return index[key]


def model_content_hash(folder: Path) -> str:
    """sha256 over the model folder's config.json and *.safetensors files (names and contents)."""
    folder = Path(folder)
    files = [folder / "config.json", *sorted(folder.glob("*.safetensors"))]
    return hashlib.sha256("".join(f"{f.name}={file_sha256(f)};" for f in files).encode()).hexdigest()


def config_hash(**settings) -> str:
    return hashlib.sha256(json.dumps({"format": FORMAT_VERSION, **settings}, sort_keys=True).encode()).hexdigest()


def entry_path(model_hash: str, settings_hash: str) -> Path:
    return cache_folder() / f"int8-{model_hash[:16]}-{settings_hash[:16]}.safetensors"


def _payload_sha256(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        digest.update(f"{name}:{t.dtype}:{tuple(t.shape)};".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()


def _write_atomically(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # mkstemp's 0600 would hide the entry from other users of a shared cache
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_entry(path: Path, tensors: dict[str, torch.Tensor], model_hash: str, settings_hash: str) -> None:
    from safetensors.torch import save

    metadata = {"model_sha256": model_hash, "config_sha256": settings_hash, "payload_sha256": _payload_sha256(tensors)}
    _write_atomically(path, save({k: v.contiguous() for k, v in tensors.items()}, metadata=metadata))


def load_entry(path: Path, model_hash: str, settings_hash: str) -> dict[str, torch.Tensor] | None:
    """The entry's tensors, or None when it is missing, unreadable, or its hashes or bytes differ."""
    from safetensors import safe_open

    if not path.is_file():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            metadata = f.metadata() or {}
            tensors = {name: f.get_tensor(name) for name in f.keys()}
    except Exception as exc:  # truncated or not a safetensors file
        logger.warning("ignoring the unreadable int8 cache entry %s (%s); rebuilding it", path, exc)
        return None
    expected = {"model_sha256": model_hash, "config_sha256": settings_hash,
                "payload_sha256": _payload_sha256(tensors)}
    wrong = [k for k, v in expected.items() if metadata.get(k) != v]
    if wrong:
        logger.warning("ignoring the int8 cache entry %s: its %s differ; rebuilding it", path, ", ".join(wrong))
        return None
    return tensors
