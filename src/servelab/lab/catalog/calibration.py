"""Calibration profiles: the cost model's GPU constants, fitted to measurements (servelab lab calibrate).

A profile maps dotted keys to values, each one Efficiency field at one scope:
    constants.<field>          every GPU and engine
    links.<kind>.<field>       GPUs on that kind of link (nvlink, pcie)
    gpus.<gpu id>.<field>      one GPU (gpus.default.<field>: GPUs the profile has no data for)
    engines.<engine>.<field>   one serving stack (its CPU-side and API-server overheads)
The most specific scope wins; a field no scope sets keeps GPU_EFFICIENCY's prior. The shipped `public`
profile is fitted to the published reference points (data/reference/, reference.FIT_SOURCES); users save their
own under the cache folder and select them with --calibration NAME.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path

from servelab.executor.efficiency import GPU_EFFICIENCY, Efficiency
from servelab.lab.catalog.lookup import DATA_DIR
from servelab.specs import DeviceSpec

FORMAT, VERSION = "servelab-calibration", 1
DEFAULT_CALIBRATION = "public"
DEFAULT_ENGINE = "vllm"
SHIPPED_DIR = DATA_DIR / "calibrations"
# Physically plausible range of each fitted constant; the fit never leaves it and a test checks profiles.
BOUNDS = {
    "matmul": (0.05, 1.0),
    "attention": (0.05, 1.0),
    "memory": (0.3, 1.0),
    "kv_memory": (0.2, 1.0),
    "interconnect": (0.2, 1.0),
    "allreduce_latency_s": (1e-6, 100e-6),
    "step_overhead_s": (1e-6, 10e-3),
    "request_overhead_s": (0.1e-6, 200e-6),
    "token_overhead_s": (0.01e-6, 50e-6),
    "matmul_half_tokens": (1.0, 1024.0),
    "attention_half_tokens": (1.0, 4096.0),
    "layer_launch_overhead_s": (1e-6, 200e-6),
    "api_ttft_overhead_s": (10e-6, 100e-3),
    "api_final_overhead_s": (10e-6, 100e-3),
}
SCOPES = ("constants", "links", "gpus", "engines")
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def link_kind(device: DeviceSpec) -> str:
    """PCIe cards pay far more per collective call than GPUs on a switched fabric (NVLink, Infinity Fabric)."""
    return "pcie" if device.interconnect.lower().startswith("pcie") else "nvlink"


def check_key(key: str) -> None:
    parts = key.split(".")
    ok = (parts[0] in SCOPES and len(parts) == (2 if parts[0] == "constants" else 3) and parts[-1] in BOUNDS)
    if not ok:
        raise ValueError(f"calibration key {key!r} is not <scope>.[<name>.]<field> with a scope of {SCOPES} "
                         f"and a fitted field of {tuple(BOUNDS)}")


@dataclass(frozen=True)
class CalibrationProfile:
    name: str
    values: dict[str, float]
    description: str = ""
    # what the fit reports: cross-validated errors per point, the data it used
    fit: dict = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        for key, value in self.values.items():
            check_key(key)
            low, high = BOUNDS[key.rsplit(".", 1)[1]]
            if not low <= value <= high:
                raise ValueError(f"calibration {self.name!r}: {key} = {value:g} is outside [{low:g}, {high:g}]")

    def lookup(self, name: str, device: DeviceSpec, engine: str) -> float | None:
        gpu = device.id if any(k.startswith(f"gpus.{device.id}.") for k in self.values) else "default"
        for key in (f"engines.{engine}.{name}", f"gpus.{gpu}.{name}", f"links.{link_kind(device)}.{name}",
                    f"constants.{name}"):
            if key in self.values:
                return self.values[key]
        return None

    def efficiency(self, device: DeviceSpec, engine: str = DEFAULT_ENGINE) -> Efficiency:
        updates = {}
        for f in fields(Efficiency):
            if f.name in BOUNDS:
                value = self.lookup(f.name, device, engine)
                if value is not None:
                    updates[f.name] = value
        return replace(GPU_EFFICIENCY, **updates)

    def engines(self) -> list[str]:
        return sorted({k.split(".")[1] for k in self.values if k.startswith("engines.")})

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": VERSION, "name": self.name, "description": self.description,
                "values": dict(sorted(self.values.items())), "fit": self.fit}

    @classmethod
    def from_json(cls, data: dict, source: str) -> "CalibrationProfile":
        if data.get("format") != FORMAT or data.get("version") != VERSION:
            raise ValueError(f"{source} is not a version-{VERSION} servelab calibration profile")
        try:
            return cls(name=data["name"], values={k: float(v) for k, v in data["values"].items()},
                       description=data.get("description", ""), fit=dict(data.get("fit", {})))
        except (KeyError, TypeError, AttributeError) as err:
            raise ValueError(f"{source} is incomplete ({err})") from None


def user_dir() -> Path:
    root = os.environ.get("SERVELAB_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "servelab"
    return base / "lab" / "calibrations"


def calibration_path(name: str) -> Path:
    if not _NAME.fullmatch(name):
        raise ValueError(f"calibration name {name!r}: use letters, digits, '.', '_' or '-'")
    shipped = SHIPPED_DIR / f"{name}.json"
    return shipped if shipped.is_file() else user_dir() / f"{name}.json"


def calibration_names() -> list[str]:
    names = {p.stem for p in SHIPPED_DIR.glob("*.json")}
    if user_dir().is_dir():
        names |= {p.stem for p in user_dir().glob("*.json")}
    return sorted(names)


@cache
def _load(path: Path, mtime_ns: int) -> CalibrationProfile:
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the calibration profile {path}: {err}") from None
    return CalibrationProfile.from_json(data, str(path))


def load_calibration(name: str = DEFAULT_CALIBRATION) -> CalibrationProfile:
    path = calibration_path(name)
    if not path.is_file():
        raise ValueError(f"no calibration named {name!r}; choose one of {', '.join(calibration_names())} "
                         "or fit one with `servelab lab calibrate --save NAME`")
    return _load(path, path.stat().st_mtime_ns)


def save_calibration(profile: CalibrationProfile) -> Path:
    if (SHIPPED_DIR / f"{profile.name}.json").is_file():
        raise ValueError(f"{profile.name!r} is a shipped calibration; save yours under another name")
    path = calibration_path(profile.name)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile.to_json(), indent=1) + "\n")
    return path
