"""What a calibration fits to: measured serving figures with the deployment and workload that produced them.

From three sources: the published reference points (servelab.lab.catalog.reference), a `vllm bench serve
--save-result` JSON file, or servelab's own bench JSON (`servelab bench serve`). A user's files carry no
deployment, so the flags the user ran with (model, GPU, TP, engine, ...) come with them.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from functools import cached_property
from pathlib import Path

from servelab.lab.catalog import get_device, get_model
from servelab.lab.catalog.reference import DeploymentFields, load_reference_points, to_simulation
from servelab.lab.sim.deployment import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Deployment
from servelab.specs import DeviceSpec
from servelab.workload import SampledRequest, WorkloadConfig, generate_workload

# Figures a bench result file carries that calibration compares (vLLM's and servelab's keys are the same).
MEASURED_METRICS = ("output_throughput", "request_throughput", "median_ttft_ms", "median_tpot_ms", "mean_ttft_ms",
                    "mean_tpot_ms", "median_itl_ms", "median_e2el_ms")


@dataclass(frozen=True)
class Target:
    id: str
    group: str
    deployment: DeploymentFields
    workload: WorkloadConfig
    metric: str  # a key of the simulation's metrics
    value: float
    source: str = ""  # the document (or measurement file) it comes from: cross-validation holds out one at a time
    load: str = ""  # "low" or "high" where the source says (the reference points); "" unknown

    @property
    def gpu(self) -> str:
        return self.deployment.gpu

    @property
    def engine(self) -> str:
        return self.deployment.engine

    @cached_property
    def device(self) -> DeviceSpec:
        return get_device(self.deployment.gpu)

    def requests(self, num_prompts: int | None = None) -> list[SampledRequest]:
        config = self.workload
        if num_prompts is not None and num_prompts < config.num_prompts:
            config = replace(config, num_prompts=num_prompts)
        return _workload(config)

    def build(self, efficiency) -> Deployment:
        f = self.deployment
        prefill, decode = f.disaggregate or (0, 0)
        return Deployment(model=get_model(f.model), device=self.device, num_gpus=f.num_gpus, tensor_parallel_size=f.tp,
                          num_prefill_instances=prefill, num_decode_instances=decode,
                          max_num_seqs=f.max_num_seqs or DEFAULT_MAX_NUM_SEQS,
                          max_num_batched_tokens=f.max_num_batched_tokens or DEFAULT_MAX_NUM_BATCHED_TOKENS,
                          dtype=f.dtype, efficiency=efficiency, cuda_graphs=f.cuda_graphs,
                          num_scheduler_steps=f.num_scheduler_steps, mixed_batches=f.mixed_batches,
                          quantization=f.quantization,
                          first_token_from_decode=f.first_token_from_decode, async_output=f.async_output)


_WORKLOADS: dict[WorkloadConfig, list[SampledRequest]] = {}


def _workload(config: WorkloadConfig) -> list[SampledRequest]:
    """Seeded and deterministic, so a fit draws each target's requests once."""
    if config not in _WORKLOADS:
        _WORKLOADS[config] = generate_workload(config)
    return _WORKLOADS[config]


def point_target(p) -> Target:
    sim = to_simulation(p)
    return Target(p.id, p.group, sim.deployment, sim.workload, sim.metric, p.metric.value, p.source.url, p.load)


def reference_targets() -> list[Target]:
    """The points the shipped calibration is fitted to (reference.FIT_SOURCES)."""
    return [point_target(p) for p in load_reference_points()]


def other_source_targets() -> list[Target]:
    """The reference set's other sources' points that the lab can simulate: predicted by the fit, never fitted."""
    from servelab.lab.catalog.reference import FIT_SOURCES, lab_gaps
    from servelab.lab.catalog.reference_files import load_sources
    return [point_target(p) for s in load_sources() if s.id not in FIT_SOURCES for p in s.points if not lab_gaps(p)]


def measurement_targets(path: Path, deployment: DeploymentFields, metrics: tuple[str, ...] = MEASURED_METRICS,
                        seed: int = 0) -> list[Target]:
    """The figures of one bench result file (vLLM's `--save-result` or servelab's bench JSON), simulated with
    a random workload of the lengths the file reports (per request when it lists them, else their means)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"cannot read the measurement file {path}: {err}") from None
    if isinstance(data.get("summary"), dict):  # servelab's bench JSON keeps the figures under "summary"
        data = {**data, **data["summary"]}
    completed = data.get("completed") or data.get("num_prompts")
    if not completed:
        raise ValueError(f"{path}: no 'completed' request count: not a vLLM or servelab bench result")
    lens_in, lens_out = data.get("input_lens"), data.get("output_lens")
    if lens_in and lens_out:
        input_len, output_len = round(sum(lens_in) / len(lens_in)), round(sum(lens_out) / len(lens_out))
        spread_in = max(abs(x - input_len) for x in lens_in) / input_len
        spread_out = max(abs(x - output_len) for x in lens_out) / output_len
        range_ratio = min(0.99, max(spread_in, spread_out))
    elif data.get("total_input_tokens") and data.get("total_output_tokens"):
        input_len = round(data["total_input_tokens"] / completed)
        output_len = round(data["total_output_tokens"] / completed)
        range_ratio = 0.0
    else:
        raise ValueError(f"{path}: neither per-request lengths (input_lens, output_lens) nor token totals")
    rate = data.get("request_rate", "inf")
    rate = math.inf if rate in ("inf", None) or float(rate) == math.inf else float(rate)
    burstiness = float(data.get("burstiness") or 1.0)
    workload = WorkloadConfig(dataset="random", num_prompts=int(completed), input_len=max(1, input_len),
                              output_len=max(1, output_len), range_ratio=range_ratio, request_rate=rate,
                              burstiness=burstiness, seed=seed)
    found = [m for m in metrics if isinstance(data.get(m), (int, float)) and data[m] > 0]
    if not found:
        raise ValueError(f"{path}: none of {', '.join(metrics)} is present")
    group = "measured"
    return [Target(f"{Path(path).stem}:{m}", group, deployment, workload, m, float(data[m]), str(path)) for m in found]
