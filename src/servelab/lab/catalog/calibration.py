"""Calibration profiles: the cost model's GPU constants, fitted to measurements (servelab lab calibrate).

A profile maps dotted keys to values, each one Efficiency field at one scope:
    constants.<field>          every GPU and engine
    links.<kind>.<field>       GPUs on that kind of link (nvlink, pcie)
    gpus.<gpu id>.<field>      one GPU
    families.<family>.<field>  GPUs of one architecture family without constants of their own (the
                               geometric mean of the family's fitted GPUs: an H200 takes the H100's)
    engines.<engine>.<field>   one serving stack (its CPU-side and API-server overheads)
The most specific scope wins; a field no scope sets keeps its prior (ENGINE_PRIORS for an engine's
overheads, else GPU_EFFICIENCY). A family with no fitted GPU takes its lineage's (FAMILY_LINEAGE), never a
mean over unlike chips. The shipped `public` profile is fitted to the published reference points
(data/reference/, reference.FIT_SOURCES); users save their
own under the cache folder and select them with --calibration NAME.
"""
from __future__ import annotations

import json
import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from functools import cache
from pathlib import Path

from servelab.executor.efficiency import ENGINE_PRIORS, GPU_EFFICIENCY, Efficiency
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
    "memory": (0.5, 1.0),
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
# Why each bound is where it is: a fitted constant that ends at a bound is read against this.
BOUND_REASONS = {
    "matmul": "a share of the datasheet's dense peak: above 1 is impossible; below 5% no tuned GEMM library runs",
    "attention": "as matmul: FlashAttention-2/3 reach 35-75% of peak (Dao 2023; Shah et al. 2024)",
    "memory": "weight-streaming GEMVs: at most the GPU's STREAM-like ceiling (memory_ceiling in gpus.json, applied "
              "in the cost model); below half of peak a kernel is broken, so a fit that wants less is absorbing "
              "something else (a quantized kernel's dequantization, an engine's overhead) and must not",
    "kv_memory": "paged KV reads scatter over blocks: PagedAttention measured 20-30% slower than contiguous reads "
                 "(Kwon et al. 2023), never faster than the STREAM-like ceiling",
    "interconnect": "share of the link a ring all-reduce reaches: nccl-tests bus bandwidth 20% (PCIe through the "
                    "host bridge) to ~100% of one direction",
    "allreduce_latency_s": "nccl-tests small-message all-reduce: 1 us at best, 100 us on a slow PCIe bridge",
    "step_overhead_s": "CPU work per engine step: from a C++ runtime's microseconds to vLLM V0's ~10 ms at large "
                       "batches (RFC #6801)",
    "request_overhead_s": "per scheduled request: 0.1 us (a C++ loop) to V0's ~80 us (RFC #6801)",
    "token_overhead_s": "per scheduled token of input preparation",
    "matmul_half_tokens": "rows at which a GEMM reaches half its peak share: one row to a few waves of 128-row tiles "
                          "(also capped per GPU at the roofline's ridge point in the cost model)",
    "attention_half_tokens": "as matmul_half_tokens for attention kernels, up to 4,096 query rows",
    "layer_launch_overhead_s": "eager kernel launches per decoder layer: ~12 kernels at 0.1-15 us each",
    "api_ttft_overhead_s": "API server work before the first token: HTTP, tokenization (10 us to 100 ms)",
    "api_final_overhead_s": "API server work after the last token: detokenization, the closing chunk",
}
SCOPES = ("constants", "links", "gpus", "families", "engines")
# A family with no fitted GPU takes the constants of the family its kernels descend from: Blackwell's
# tcgen05 GEMMs from Hopper's TMA + wgmma pipelines, Ada's SM (no TMA, no wgmma) from Ampere's.
FAMILY_LINEAGE = {"blackwell": "hopper", "ada": "ampere", "cdna4": "cdna3"}
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def link_kind(device: DeviceSpec) -> str:
    """PCIe cards pay far more per collective call than GPUs on a switched fabric (NVLink, Infinity Fabric)."""
    return "pcie" if device.interconnect.lower().startswith("pcie") else "nvlink"


def with_family_defaults(values: dict[str, float], targets) -> dict[str, float]:
    """Adds families.<family>.<field>: the geometric mean over the family's fitted GPUs, for its GPUs without
    data. GPUs whose every point ran a weight-only quantized checkpoint (quantized_only_gpus) are left out:
    their constants carry the dequantizing kernels' efficiency along with the chip's."""
    from servelab.lab.catalog.lookup import get_device
    out = {k: v for k, v in values.items() if not k.startswith("families.")}
    dense = {t.gpu for t in targets if not t.deployment.quantization}
    fitted: dict[tuple[str, str], list[float]] = {}
    for key, value in out.items():
        scope, gpu, name = (key.split(".") + ["", ""])[:3]
        if scope == "gpus" and gpu in dense:
            fitted.setdefault((get_device(gpu).family, name), []).append(value)
    for (family, name), found in sorted(fitted.items()):
        out[f"families.{family}.{name}"] = float(math.exp(sum(map(math.log, found)) / len(found)))
    return out


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
        """The most specific scope's value; a GPU with none of its own takes its family's (or its lineage's)."""
        keys = [f"engines.{engine}.{name}"]
        if any(k.startswith(f"gpus.{device.id}.") for k in self.values):
            keys.append(f"gpus.{device.id}.{name}")
        else:
            keys += [f"families.{device.family}.{name}", f"families.{FAMILY_LINEAGE.get(device.family, '')}.{name}"]
        keys += [f"links.{link_kind(device)}.{name}", f"constants.{name}"]
        return next((self.values[key] for key in keys if key in self.values), None)

    def efficiency(self, device: DeviceSpec, engine: str = DEFAULT_ENGINE) -> Efficiency:
        updates = dict(ENGINE_PRIORS.get(engine, {}))
        for f in fields(Efficiency):
            if f.name in BOUNDS:
                value = self.lookup(f.name, device, engine)
                if value is not None:
                    updates[f.name] = value
        return replace(GPU_EFFICIENCY, **updates)

    def engines(self) -> list[str]:
        """Engines it prices: those it fitted and those with published priors."""
        return sorted({k.split(".")[1] for k in self.values if k.startswith("engines.")} | set(ENGINE_PRIORS))

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
