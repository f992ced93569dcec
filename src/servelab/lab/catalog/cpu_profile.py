"""This machine as a lab device: the CPU profile that `servelab lab profile` fits and `--gpu local-cpu` reads.

Stored as JSON at $SERVELAB_CACHE_DIR/lab/local-cpu.json (default ~/.cache/servelab/lab/local-cpu.json):

  {"format": "servelab-lab-cpu-profile", "version": 1,
   "device": {"name": ..., "flops": F, "memory_bandwidth": B, "memory_bytes": M},
   "efficiency": {"matmul": 1.0, "attention": a, "memory": 1.0, "kv_memory": k,
                  "step_overhead_s": o, "request_overhead_s": r,
                  "layers_curve": {"x": [tokens...], "seconds": [...]},
                  "lm_head_curve": {"x": [rows...], "seconds": [...]},
                  "overhead_curve": {"x": [requests...], "seconds": [...]},
                  "all_reduce": [{"world_size": 2, "latency_s": a, "bytes_per_s": b, "samples": [...]}, ...]},
   "kv_cache_bytes": K, "dtype": "bfloat16", "quantization": "int8", "kv_cache_dtype": "int8",
   "max_num_seqs": S, "max_num_batched_tokens": T,
   "fit": {"model": "smollm2-135m", "num_samples": n, "mean_abs_rel_error": e, ...},
   "kv_transfer": {"latency_s": l, "bytes_per_s": b, "samples": [[bytes, seconds], ...]},
   "spec_decode": {"speculative_config": {...}, "fitted_acceptance_rate": a, "acceptance_rate": r, ...},
   "created": "ISO time", "host": "..."}

The two curves price a step's linear layers (measured, see executor/curve.py); device.flops and
device.memory_bandwidth are the effective matmul FLOP/s and weight-streaming bytes/s read off them (for
the meters' capacity figures), so matmul and memory efficiencies are 1.0; attention and kv_memory are
fitted fractions of them. overhead_curve is what serving adds to a step of that many requests. all_reduce is the gloo all-reduce
between 2 and 3 processes on this machine (alpha-beta fit), so the lab prices `-tp 2` and `-tp 3` here (the
device then counts as that many "GPUs" per node: processes sharing the same cores).
kv_cache_bytes, max_num_seqs and max_num_batched_tokens are the real engine's settings when profiled,
so a simulation of local-cpu runs the scheduler with the pool and limits `servelab serve` uses.
quantization and kv_cache_dtype are the mode the engine was profiled in, --quantization auto resolved as
`servelab serve` resolves it (none = float weights in dtype; kv_cache_dtype auto = the cache in dtype, int8 =
int8 rows with an fp32 scale each): the curves price that mode's steps, the KV term and the pool's blocks its
bytes per token. Profiles written before these fields load as none / auto.
kv_transfer (optional: profiles measured before it lack it) is the torch.distributed point-to-point
send between two processes that a disaggregated deployment's KV handoff pays.
spec_decode (optional) is prompt-lookup speculation measured on code-edit prompts
(lab/calibrate/spec_acceptance.py): its fitted_acceptance_rate is `lab simulate --spec-acceptance-rate`'s
default on local-cpu.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from pathlib import Path

from servelab.executor.efficiency import AllReduceFit, Efficiency
from servelab.executor.curve import PiecewiseLinear
from servelab.specs import DeviceSpec, ModelSpec, kv_dtype

LOCAL_CPU = "local-cpu"

PROFILE_FORMAT = "servelab-lab-cpu-profile"
PROFILE_VERSION = 2
CURVES = ("layers_curve", "lm_head_curve", "overhead_curve")


@dataclass(frozen=True)
class CpuProfile:
    device: DeviceSpec
    efficiency: Efficiency
    kv_cache_bytes: int
    dtype: str
    max_num_seqs: int
    max_num_batched_tokens: int
    fit: dict = field(default_factory=dict)
    quantization: str = "none"  # the engine's --quantization as resolved: none, int8 or gguf
    kv_cache_dtype: str = "auto"  # the engine's --kv-cache-dtype: auto (dtype) or int8
    created: str = ""
    host: str = ""
    kv_transfer: dict = field(default_factory=dict)  # latency_s, bytes_per_s, samples
    spec_decode: dict = field(default_factory=dict)  # lab/calibrate/spec_acceptance.py

    @property
    def kv_transfer_link(self) -> tuple[float, float]:
        """(latency_s, bytes_per_s) of one KV handoff between two instances here."""
        if not self.kv_transfer:
            raise ValueError("the local-cpu profile has no KV-transfer figures; run `servelab lab profile` "
                             "(or `servelab lab profile --kv-transfer-only`) again")
        return float(self.kv_transfer["latency_s"]), float(self.kv_transfer["bytes_per_s"])

    @property
    def kv_dtype(self) -> str:
        """The KV cache's dtype as ModelSpec.kv_bytes_per_token reads it."""
        return kv_dtype(self.dtype, self.kv_cache_dtype)

    @property
    def block_size(self) -> int:
        return self.fit.get("block_size", 16)

    def num_kv_blocks(self, model: ModelSpec) -> int:
        """The profiled engine's KV blocks: its pool's bytes over a block's bytes in its cache dtype."""
        return self.kv_cache_bytes // (self.block_size * model.kv_bytes_per_token(self.kv_dtype))

    @property
    def mode(self) -> str:
        """The engine flags of the profiled mode."""
        return f"--dtype {self.dtype} --quantization {self.quantization} --kv-cache-dtype {self.kv_cache_dtype}"

    def to_json(self) -> dict:
        d = self.device
        return {
            "format": PROFILE_FORMAT, "version": PROFILE_VERSION,
            "device": {"name": d.name, "flops": d.flops, "memory_bandwidth": d.memory_bandwidth,
                       "memory_bytes": d.memory_bytes},
            "efficiency": _efficiency_json(self.efficiency),
            "kv_cache_bytes": self.kv_cache_bytes, "dtype": self.dtype, "quantization": self.quantization,
            "kv_cache_dtype": self.kv_cache_dtype,
            "max_num_seqs": self.max_num_seqs, "max_num_batched_tokens": self.max_num_batched_tokens,
            "fit": self.fit, "created": self.created, "host": self.host,
            **({"kv_transfer": self.kv_transfer} if self.kv_transfer else {}),
            **({"spec_decode": self.spec_decode} if self.spec_decode else {}),
        }

    def check_model(self, model: ModelSpec) -> None:
        """The measured curves price the profiled model only."""
        profiled = self.fit.get("model_shape")
        if profiled is not None and profiled != model_shape(model):
            raise ValueError(f"the local-cpu profile was measured with {self.fit.get('model')}, not {model.name}; "
                             f"run `servelab lab profile --model ...` for it")

    @classmethod
    def from_json(cls, data: dict, source: str = "") -> "CpuProfile":
        if data.get("format") != PROFILE_FORMAT or data.get("version") != PROFILE_VERSION:
            raise ValueError(f"{source or 'CPU profile'} is not a version-{PROFILE_VERSION} servelab CPU profile; "
                             "run `servelab lab profile` again")
        try:
            d, e = data["device"], data["efficiency"]
            tp_sizes = [int(f["world_size"]) for f in e.get("all_reduce", ())]
            device = DeviceSpec(
                id=LOCAL_CPU, name=d["name"], flops=float(d["flops"]), memory_bandwidth=float(d["memory_bandwidth"]),
                memory_bytes=int(d["memory_bytes"]), interconnect="none", interconnect_bandwidth=0.0,
                network_bandwidth=0.0, gpus_per_node=max([1, *tp_sizes]),
                source=f"servelab lab profile ({source})",
            )
            all_reduce = tuple(AllReduceFit(int(f["world_size"]), float(f["latency_s"]), float(f["bytes_per_s"]),
                                            tuple((int(b), float(t)) for b, t in f.get("samples", ())))
                               for f in e.get("all_reduce", ()))
            efficiency = Efficiency(interconnect=1.0, allreduce_latency_s=0.0, all_reduce=all_reduce,
                                    **{k: PiecewiseLinear.from_json(v) if k in CURVES else float(v)
                                       for k, v in e.items() if k != "all_reduce"})
            return cls(device=device, efficiency=efficiency, kv_cache_bytes=int(data["kv_cache_bytes"]),
                       dtype=data["dtype"], quantization=data.get("quantization", "none"),
                       kv_cache_dtype=data.get("kv_cache_dtype", "auto"), max_num_seqs=int(data["max_num_seqs"]),
                       max_num_batched_tokens=int(data["max_num_batched_tokens"]), fit=dict(data.get("fit", {})),
                       created=data.get("created", ""), host=data.get("host", ""),
                       kv_transfer=dict(data.get("kv_transfer", {})), spec_decode=dict(data.get("spec_decode", {})))
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{source or 'CPU profile'} is incomplete ({err}); run `servelab lab profile` again") from None


def model_shape(model: ModelSpec) -> list[int]:
    return [model.hidden_size, model.intermediate_size, model.num_hidden_layers, model.num_attention_heads,
            model.num_key_value_heads, model.head_dim, model.vocab_size, model.num_experts]


# Constants a CPU profile does not measure (one device, no API server of its own, no CUDA graphs): left at
# their defaults and out of the profile file.
GPU_ONLY = ("interconnect", "allreduce_latency_s", "token_overhead_s", "matmul_half_tokens", "attention_half_tokens",
            "layer_launch_overhead_s", "api_ttft_overhead_s", "api_final_overhead_s")


def _efficiency_json(e: Efficiency) -> dict:
    out = {}
    for f in fields(e):
        value = getattr(e, f.name)
        if f.name in CURVES:
            if value is not None:
                out[f.name] = value.to_json()
        elif f.name == "all_reduce":
            out[f.name] = [{"world_size": a.world_size, "latency_s": a.latency_s, "bytes_per_s": a.bytes_per_s,
                            "samples": [list(x) for x in a.samples]} for a in value]
        elif f.name not in GPU_ONLY:
            out[f.name] = value
    return out


def read_json(path: Path, what: str):
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read {what} {path}: {err}") from None


def profile_path() -> Path:
    root = os.environ.get("SERVELAB_CACHE_DIR")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "servelab"
    return base / "lab" / f"{LOCAL_CPU}.json"


def load_cpu_profile(path: Path | None = None) -> CpuProfile:
    path = path or profile_path()
    if not path.is_file():
        raise ValueError(f"no CPU profile at {path}; run `servelab lab profile` first")
    return CpuProfile.from_json(read_json(path, "the CPU profile"), source=str(path))


def save_cpu_profile(profile: CpuProfile, path: Path | None = None) -> Path:
    path = path or profile_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(profile.to_json(), indent=2) + "\n")
    tmp.replace(path)
    return path
