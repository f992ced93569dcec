"""GPU and model catalogs: data/gpus.json and data/models.json, each entry with its public source, looked up
as servelab.specs DeviceSpec and ModelSpec."""
from __future__ import annotations

import json
from functools import cache
from pathlib import Path

from servelab.lab.catalog.cpu_profile import LOCAL_CPU, load_cpu_profile, read_json
from servelab.specs import GIB, DeviceSpec, ModelSpec

DATA_DIR = Path(__file__).parent / "data"


@cache
def _load(name: str) -> dict:
    with open(DATA_DIR / name) as f:
        return {k: v for k, v in json.load(f).items() if not k.startswith("_")}


def gpu_ids() -> list[str]:
    return list(_load("gpus.json"))


def model_ids() -> list[str]:
    return list(_load("models.json"))


def get_device(device_id: str) -> DeviceSpec:
    if device_id == LOCAL_CPU:
        return load_cpu_profile().device
    entries = _load("gpus.json")
    if device_id not in entries:
        raise ValueError(f"unknown GPU {device_id!r}; choose one of {', '.join(gpu_ids())}, or {LOCAL_CPU}")
    e = entries[device_id]
    return DeviceSpec(
        id=device_id, name=e["name"], flops=e["flops"], memory_bandwidth=e["memory_bandwidth"],
        memory_bytes=int(e["memory_gib"] * GIB), interconnect=e["interconnect"],
        interconnect_bandwidth=e["interconnect_bandwidth"], network_bandwidth=e["network_bandwidth"],
        gpus_per_node=e["gpus_per_node"], source=e["source"], compute_units=e["compute_units"],
        family=e["family"], fp8_flops=e.get("fp8_flops"), fp4_flops=e.get("fp4_flops"),
        memory_ceiling=e["memory_ceiling"],
    )


def get_model(model: str) -> ModelSpec:
    """A catalog id, or a path to a Hugging Face config.json (or the folder holding one)."""
    entries = _load("models.json")
    if model in entries:
        e = entries[model]
        return ModelSpec.from_hf_config(e["config"], id=model, name=e["name"], source=e["source"])
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(model_ids())}, or give a config.json path")
    cfg = read_json(path, "the model config")
    return ModelSpec.from_hf_config(cfg, id=str(model), name=path.parent.name or str(path), source=str(path))
