"""Published GPU serving measurements (data/reference/<source>.json, one file per source document) as typed
points, and how the lab simulates each one: the deployment, the workload and the metric key to compare with the
published value. servelab.lab.catalog.reference_files reads every source; load_reference_points() gives the
points of the sources the shipped calibration is fitted to (FIT_SOURCES)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from functools import cache

from servelab.lab.catalog.lookup import DATA_DIR, gpu_ids, model_ids
from servelab.specs import DTYPE_BYTES, QUANTIZATION_BYTES
from servelab.workload import ARRIVAL_RNGS, DATASETS, WorkloadConfig

REFERENCE_DIR = DATA_DIR / "reference"
# The sources (file stems in REFERENCE_DIR) the shipped calibration is fitted to, in the fit's order (its
# cross-validation deals the points into folds in this order).
FIT_SOURCES = ("sglang-benchmark-vllm060", "vllm-blog-v060-perf", "vllm-blog-mi300x", "nemo-llama-inference",
               "mooncake-vllm-v0.2")
# The keys of the lab's `metrics` dict that a published figure can be compared with.
METRICS = frozenset({"request_throughput", "output_throughput", "total_token_throughput"} | {
    f"{stat}_{name}_ms" for stat in ("mean", "median", "p90", "p99") for name in ("ttft", "tpot", "itl", "e2el")})
UNITS = {"ms", "tok/s", "req/s"}
GROUPS = ("latency-batch<=8", "low-load-ttft", "low-load-tpot", "loaded-latency", "throughput", "disaggregated")
READ_FROM = ("table", "text", "figure")
DEPLOYMENT_FLAGS = ("engine", "num_scheduler_steps", "cuda_graphs")
# set only where the source ran them: a weight-quantized checkpoint, a disaggregation proxy that streams
# the answer from the decode instance, prefills in steps of their own (no chunked prefill / mixed chunks)
OPTIONAL_DEPLOYMENT_FLAGS = ("quantization", "first_token_from_decode", "mixed_batches", "async_output")


@dataclass(frozen=True)
class Source:
    url: str
    where: str
    title: str
    date: str


@dataclass(frozen=True)
class SimulatedWorkload:
    """How the lab draws the source's workload: a servelab dataset and the lengths it needs."""
    dataset: str
    num_prompts: int
    input_len: int | None
    output_len: int | None
    sharegpt_like_matches: bool | None  # None: the source's dataset is not ShareGPT
    why: str
    # the source's own arrival trace where it is known (workload.ARRIVAL_RNGS); optional in the data
    arrival_rng: str = "servelab"
    # the run's published mean output where its client let outputs end at EOS (WorkloadConfig.eos_mean_output);
    # optional in the data
    eos_mean_output: float | None = None
    # random only: lengths uniform in [len * (1 - r), len * (1 + r)] (WorkloadConfig.range_ratio); optional in the data
    range_ratio: float = 0.0


@dataclass(frozen=True)
class Workload:
    dataset: str
    lengths: str  # as the source describes them
    request_rate: float  # math.inf: all at once
    max_concurrency: int | None
    num_requests: int | None  # None: the source does not say
    arrivals: str
    simulate: SimulatedWorkload


@dataclass(frozen=True)
class Metric:
    name: str
    value: float
    unit: str
    read_from: str
    tolerance: float | None  # absolute, in unit; set when read off a figure


@dataclass(frozen=True)
class ReferencePoint:
    id: str
    source: Source
    engine: str
    engine_version: str
    engine_flags: str
    engine_settings: dict  # max_num_seqs / max_num_batched_tokens the source set
    deployment_flags: dict  # engine (a calibration's engine key), num_scheduler_steps, cuda_graphs
    gpu: str
    num_gpus: int
    model: str
    dtype: str
    tp: int
    pp: int
    disaggregation: tuple[int, int] | None  # (prefill, decode) instances
    workload: Workload
    metric: Metric
    group: str
    load: str  # "low" or "high"
    notes: str


@dataclass(frozen=True)
class DeploymentFields:
    """The servelab.lab.api.DeploymentRequest fields a point sets (the catalog sits below the API layer)."""
    model: str
    gpu: str
    dtype: str
    num_gpus: int
    tp: int
    disaggregate: tuple[int, int] | None
    max_num_seqs: int | None
    max_num_batched_tokens: int | None
    engine: str
    num_scheduler_steps: int
    cuda_graphs: bool
    quantization: str | None = None
    first_token_from_decode: bool = False
    mixed_batches: bool = True
    async_output: bool = False

    def as_kwargs(self) -> dict:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Simulation:
    deployment: DeploymentFields
    workload: WorkloadConfig
    metric: str  # key of the simulation's `metrics`


class ReferenceDataError(ValueError):
    pass


def _require(entry: dict, fields: tuple[str, ...], where: str) -> None:
    missing = [f for f in fields if f not in entry]
    if missing:
        raise ReferenceDataError(f"{where}: missing field(s) {', '.join(missing)}")


def _rate(value) -> float:
    return math.inf if value == "inf" else float(value)


def parse_point(entry: dict, check_catalog: bool = True) -> ReferencePoint:
    """One point of a reference file; check_catalog=False accepts a GPU, model, dtype or quantization the lab's
    catalog does not have yet (catalog_gaps names them)."""
    pid = entry.get("id", "<no id>")
    _require(entry, tuple(ReferencePoint.__dataclass_fields__), pid)
    _require(entry["source"], tuple(Source.__dataclass_fields__), f"{pid}.source")
    _require(entry["workload"], tuple(Workload.__dataclass_fields__), f"{pid}.workload")
    _require(entry["workload"]["simulate"], tuple(f for f in SimulatedWorkload.__dataclass_fields__
                                                       if f not in ("arrival_rng", "eos_mean_output", "range_ratio")),
             f"{pid}.workload.simulate")
    _require(entry["metric"], tuple(Metric.__dataclass_fields__), f"{pid}.metric")
    w = entry["workload"]
    disagg = entry["disaggregation"]
    point = ReferencePoint(
        **{**entry, "source": Source(**entry["source"]), "metric": Metric(**entry["metric"]),
           "disaggregation": tuple(int(n) for n in disagg.split(":")) if disagg else None,
           "workload": Workload(**{**w, "request_rate": _rate(w["request_rate"]),
                                   "simulate": SimulatedWorkload(**w["simulate"])})})
    validate(point, check_catalog)
    return point


def catalog_gaps(p: ReferencePoint) -> list[str]:
    """The catalog entries the lab lacks to simulate the point."""
    return [message for ok, message in (
        (p.gpu in gpu_ids(), f"unknown GPU {p.gpu!r}"),
        (p.model in model_ids(), f"unknown model {p.model!r}"),
        (p.dtype in DTYPE_BYTES, f"unknown dtype {p.dtype!r}"),
        (p.deployment_flags.get("quantization") in (None, *QUANTIZATION_BYTES), "unknown quantization"),
    ) if not ok]


def lab_gaps(p: ReferencePoint) -> list[str]:
    """Everything the lab lacks to simulate the point: catalog entries and workload features."""
    return catalog_gaps(p) + (["closed-loop client (max_concurrency requests in flight)"] if closed_loop(p) else [])


def closed_loop(p: ReferencePoint) -> bool:
    """The source's client kept max_concurrency > 1 requests in flight over more requests than that: WorkloadConfig
    has no such client. A concurrency that equals the request count is one batch, and concurrency 1 runs each
    request alone (simulated as one request): the lab has both."""
    w = p.workload
    return (w.max_concurrency or 1) > 1 and (w.num_requests is None or w.max_concurrency < w.num_requests)


def validate(p: ReferencePoint, check_catalog: bool = True) -> None:
    s, m = p.workload.simulate, p.metric
    checks = [(False, gap) for gap in (catalog_gaps(p) if check_catalog else [])] + [
        (m.name in METRICS, f"unknown metric {m.name!r}"),
        (m.unit in UNITS, f"unknown unit {m.unit!r}"),
        (m.read_from in READ_FROM, f"read_from must be one of {READ_FROM}"),
        (m.read_from != "figure" or m.tolerance is not None, "a value read off a figure needs a tolerance"),
        (m.value > 0, "metric value must be > 0"),
        (p.group in GROUPS, f"unknown group {p.group!r}"),
        (p.load in ("low", "high"), "load must be low or high"),
        (s.dataset in DATASETS, f"unknown servelab dataset {s.dataset!r}"),
        (s.arrival_rng in ARRIVAL_RNGS, f"arrival_rng must be one of {ARRIVAL_RNGS}"),
        (s.eos_mean_output is None or s.dataset == "sharegpt-llama3" and s.eos_mean_output >= 1,
         "eos_mean_output cuts sharegpt-llama3's lengths: it needs that dataset and is >= 1"),
        (p.tp >= 1 and p.pp == 1, "tp must be >= 1; the lab has no pipeline parallelism"),
        (p.num_gpus == p.tp * sum(p.disaggregation) if p.disaggregation else p.num_gpus % p.tp == 0,
         "num_gpus must be a multiple of tp, and (P + D) * tp when disaggregated"),
        ((p.group == "disaggregated") == (p.disaggregation is not None), "disaggregated points and only they set P:D"),
        (all(k in ("max_num_seqs", "max_num_batched_tokens") for k in p.engine_settings),
         "engine_settings may set max_num_seqs and max_num_batched_tokens"),
        (set(DEPLOYMENT_FLAGS) <= set(p.deployment_flags) <= set(DEPLOYMENT_FLAGS + OPTIONAL_DEPLOYMENT_FLAGS)
         and isinstance(p.deployment_flags["engine"], str)
         and isinstance(p.deployment_flags["cuda_graphs"], bool) and p.deployment_flags["num_scheduler_steps"] >= 1,
         f"deployment_flags must set {', '.join(DEPLOYMENT_FLAGS)} and may set {', '.join(OPTIONAL_DEPLOYMENT_FLAGS)}"),
        (isinstance(p.deployment_flags.get("mixed_batches", True), bool), "mixed_batches must be true or false"),
        (isinstance(p.deployment_flags.get("async_output", False), bool), "async_output must be true or false"),
        (not p.deployment_flags.get("first_token_from_decode") or p.disaggregation is not None,
         "first_token_from_decode needs a disaggregated point"),
        (bool(p.source.url.startswith("https://") and p.source.where), "source needs an https URL and a location"),
    ]
    for ok, message in checks:
        if not ok:
            raise ReferenceDataError(f"{p.id}: {message}")


def read_points_file(path) -> list[dict]:
    """The raw point entries of one reference file (a source file's or a user's {"points": [...]})."""
    with open(path) as f:
        return json.load(f)["points"]


def check_unique_ids(points) -> None:
    ids = [p.id for p in points]
    if len(set(ids)) != len(ids):
        raise ReferenceDataError(f"duplicate ids: {sorted({i for i in ids if ids.count(i) > 1})}")


@cache
def load_reference_points() -> tuple[ReferencePoint, ...]:
    """The points of FIT_SOURCES, in that order: the set the shipped calibration is fitted to."""
    points = tuple(parse_point(e) for source in FIT_SOURCES for e in read_points_file(REFERENCE_DIR / f"{source}.json"))
    check_unique_ids(points)
    return points


def to_simulation(point: ReferencePoint, num_prompts: int | None = None, seed: int = 0) -> Simulation:
    """The lab run that reproduces `point`; num_prompts caps the source's request count (fast tests) and never
    raises it, so a batch of 8 stays a batch of 8."""
    if closed_loop(point):
        raise ReferenceDataError(f"{point.id}: its client kept {point.workload.max_concurrency} requests in flight; "
                                 "the lab's workload has no closed-loop client")
    s = point.workload.simulate
    deployment = DeploymentFields(
        model=point.model, gpu=point.gpu, dtype=point.dtype, num_gpus=point.num_gpus, tp=point.tp,
        disaggregate=point.disaggregation, max_num_seqs=point.engine_settings.get("max_num_seqs"),
        max_num_batched_tokens=point.engine_settings.get("max_num_batched_tokens"), **point.deployment_flags)
    workload = WorkloadConfig(dataset=s.dataset, num_prompts=min(num_prompts or s.num_prompts, s.num_prompts), input_len=s.input_len,
                              output_len=s.output_len, request_rate=point.workload.request_rate, seed=seed,
                              arrival_rng=s.arrival_rng, eos_mean_output=s.eos_mean_output,
                              range_ratio=s.range_ratio)
    return Simulation(deployment, workload, point.metric.name)
