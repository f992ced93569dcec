"""The lab's typed API: simulate, advise and sweep as functions of frozen request values. `servelab lab ...`
builds the requests from flags and the /lab page from JSON; both call these and print the same bytes.

Bad input raises servelab.errors.FieldError, naming fields by their names here (`num_gpus`, `tp`,
`ttft_target_ms`); each front-end renders them in its own vocabulary.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

from servelab.config import SpeculativeConfig
from servelab.errors import FieldError
from servelab.lab.analysis.autoscale_policies import AutoscalePolicyConfig
from servelab.lab.analysis.autoscaling import AutoscaleOutcome, AutoscaleSettings, evaluate_autoscaling
from servelab.lab.analysis.slo_attribution import attribute_slo_misses
from servelab.lab.analysis.advisor import DEFAULT_MAX_GPUS, Advice, advise as advise_deployment
from servelab.lab.analysis.decisions import simulated_autoscaling
from servelab.lab.analysis.error_band import error_bands
from servelab.lab.analysis.evaluate import Evaluation, Targets, evaluate
from servelab.lab.analysis.sweep import parse_values, plot_sweep, run_sweep
from servelab.lab.catalog import LOCAL_CPU, get_device, get_model, gpu_ids
from servelab.lab.catalog.calibration import DEFAULT_CALIBRATION, DEFAULT_ENGINE, load_calibration
from servelab.lab.sim.deployment import DEFAULT_MAX_NUM_BATCHED_TOKENS, DEFAULT_MAX_NUM_SEQS, Deployment
from servelab.lab.sim.scaling import ScalingConfig
from servelab.workload import WorkloadConfig, describe, generate_workload

if TYPE_CHECKING:
    from servelab.lab.analysis.frontier import Frontier

DOES_NOT_FIT = 1


@dataclass(frozen=True)
class DeploymentRequest:
    """A deployment as a user describes it; None takes the device's default (vLLM's on a GPU, the profiled
    engine's settings on local-cpu)."""
    model: str = "llama-3.1-8b"
    gpu: str = "h100"
    dtype: str | None = None
    num_gpus: int | None = None  # None: one instance's worth
    tp: int = 1
    schedule: str = "continuous"
    disaggregate: tuple[int, int] | None = None  # (prefill, decode) instances
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    block_size: int = 16
    router: str = "round-robin"
    enable_prefix_caching: bool = True
    # Which fitted GPU constants price it (servelab.lab.catalog.calibration; None: the shipped default),
    # which serving stack's overheads, and the engine flags the cost model prices.
    calibration: str | None = None
    engine: str = DEFAULT_ENGINE
    cuda_graphs: bool = True
    num_scheduler_steps: int = 1
    mixed_batches: bool = True
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    first_token_from_decode: bool = False
    async_output: bool = False  # vLLM V0's asynchronous output processing: tokens reach the client a step later
    # the engine's --speculative-config (a JSON string or its dict), and the rate its drafts are accepted at
    speculative_config: str | dict | None = None
    spec_acceptance_rate: float | None = None

    def build(self) -> Deployment:
        model, device = get_model(self.model), get_device(self.gpu)
        extra = {}
        if self.gpu == LOCAL_CPU:
            from servelab.lab.catalog.cpu_profile import load_cpu_profile
            profile = load_cpu_profile()
            profile.check_model(model)
            extra = dict(efficiency=profile.efficiency, kv_cache_bytes=profile.kv_cache_bytes)
            if self.speculative_config is not None and self.spec_acceptance_rate is None and profile.spec_decode:
                extra["spec_acceptance_rate"] = profile.spec_decode["fitted_acceptance_rate"]  # measured here
            # the profiled engine's KV cache (its fitted KV term prices those bytes)
            defaults = (profile.max_num_seqs, profile.max_num_batched_tokens, profile.dtype, profile.kv_cache_dtype)
        else:
            extra = dict(efficiency=self._calibrated_efficiency(device))
            defaults = (DEFAULT_MAX_NUM_SEQS, DEFAULT_MAX_NUM_BATCHED_TOKENS, "bfloat16", "auto")
        prefill, decode = self.disaggregate or (0, 0)
        num_gpus = self.num_gpus if self.num_gpus is not None else max(1, prefill + decode) * self.tp
        return Deployment(
            model=model, device=device, num_gpus=num_gpus, tensor_parallel_size=self.tp, schedule=self.schedule,
            num_prefill_instances=prefill, num_decode_instances=decode,
            max_num_seqs=self.max_num_seqs or defaults[0],
            max_num_batched_tokens=self.max_num_batched_tokens or defaults[1],
            block_size=self.block_size, router=self.router, dtype=self.dtype or defaults[2],
            enable_prefix_caching=self.enable_prefix_caching, cuda_graphs=self.cuda_graphs,
            num_scheduler_steps=self.num_scheduler_steps, mixed_batches=self.mixed_batches,
            quantization=self.quantization,
            kv_cache_dtype=defaults[3] if self.kv_cache_dtype == "auto" else self.kv_cache_dtype,
            first_token_from_decode=self.first_token_from_decode, async_output=self.async_output,
            speculative=self._speculative(), **{"spec_acceptance_rate": self.spec_acceptance_rate, **extra},
        )

    def _speculative(self) -> SpeculativeConfig | None:
        value = self.speculative_config
        if value is None:
            return None
        try:
            return SpeculativeConfig.from_json(value if isinstance(value, str) else json.dumps(value))
        except ValueError as err:
            raise FieldError(f"{{speculative_config}}: {str(err).removeprefix('--speculative-config ')}",
                             "speculative_config") from None

    def profiled_mode(self) -> dict | None:
        """On local-cpu, the engine mode the profile measured and the simulation prices (its curves are that
        mode's steps); None on a catalog GPU."""
        if self.gpu != LOCAL_CPU:
            return None
        from servelab.lab.catalog.cpu_profile import load_cpu_profile
        p = load_cpu_profile()
        return {"dtype": p.dtype, "quantization": p.quantization, "kv_cache_dtype": p.kv_cache_dtype, "flags": p.mode}

    def error_bands(self, e: Evaluation) -> dict | None:
        """The bands of an evaluation of this deployment (None where it has none: a CPU profile, no fit)."""
        if self.gpu == LOCAL_CPU or not e.fits:
            return None
        profile = load_calibration(self.calibration or DEFAULT_CALIBRATION)
        return error_bands(profile, e.deployment.to_json(), e.meters, e.metrics, self.engine)

    def _calibrated_efficiency(self, device):
        try:
            profile = load_calibration(self.calibration or DEFAULT_CALIBRATION)
        except ValueError as err:
            raise FieldError(f"{{calibration}}: {err}", "calibration") from None
        if self.engine not in profile.engines():
            raise FieldError(f"{{engine}} {self.engine!r} is not in calibration {profile.name!r} "
                             f"(it has {', '.join(profile.engines()) or 'none'})", "engine")
        return profile.efficiency(device, self.engine)


@dataclass(frozen=True)
class TargetsRequest:
    ttft_target_ms: float | None = None
    tpot_target_ms: float | None = None

    def build(self) -> Targets:
        return Targets(ttft_ms=self.ttft_target_ms, tpot_ms=self.tpot_target_ms)


@dataclass(frozen=True)
class AutoscaleRequest:
    """An autoscaler in front of the deployment's pools (autoscale_policies.py cites what each policy does)."""
    policy: str = "keda"
    min_replicas: int = 1
    max_replicas: int = 8
    startup_s: float = ScalingConfig.startup_s
    cooldown_s: float = AutoscalePolicyConfig.cooldown_s
    interval_s: float = AutoscalePolicyConfig.interval_s
    target_waiting: float = AutoscalePolicyConfig.target_waiting
    target_kv_usage: float = AutoscalePolicyConfig.target_kv_usage

    def build(self) -> AutoscaleSettings:
        policy = AutoscalePolicyConfig(policy=self.policy, interval_s=self.interval_s, cooldown_s=self.cooldown_s,
                                       target_waiting=self.target_waiting, target_kv_usage=self.target_kv_usage)
        return AutoscaleSettings(policy, ScalingConfig(self.min_replicas, self.max_replicas, self.startup_s))


@dataclass(frozen=True)
class SimulateRequest:
    deployment: DeploymentRequest = field(default_factory=DeploymentRequest)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    targets: TargetsRequest = field(default_factory=TargetsRequest)
    multi_step: bool = True  # False prices every step separately (same result, slower)
    autoscale: AutoscaleRequest | None = None
    slo_attribution: bool = False  # where the latency of the requests missing a target went


@dataclass(frozen=True)
class AdviseRequest:
    deployment: DeploymentRequest = field(default_factory=DeploymentRequest)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    targets: TargetsRequest = field(default_factory=TargetsRequest)
    max_gpus: int = DEFAULT_MAX_GPUS
    # The recommended shape autoscaled over the workload's rate schedule: the GPU autoscaling decision then
    # cites that simulated comparison.
    autoscale: AutoscaleRequest | None = None


@dataclass(frozen=True)
class SweepRequest:
    vary: str
    values: str  # comma-separated
    deployment: DeploymentRequest = field(default_factory=DeploymentRequest)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    targets: TargetsRequest = field(default_factory=TargetsRequest)
    meter: str = "p99_ttft_ms"
    output: Path = Path("lab-sweep.png")


@dataclass(frozen=True)
class FrontierRequest:
    """The cost frontier over gpus (catalog ids) for the deployment's model and engine settings."""
    gpus: tuple[str, ...] = ("h100", "h200", "a100-80gb", "mi300x")
    deployment: DeploymentRequest = field(default_factory=DeploymentRequest)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    targets: TargetsRequest = field(default_factory=TargetsRequest)
    max_gpus: int = 16
    max_num_seqs: tuple[int, ...] = (64, 256)
    latency_metric: str = "p99_ttft_ms"
    prices_file: Path | None = None  # replaces the shipped prices
    prices: tuple[tuple[str, float], ...] = ()  # (gpu, usd per GPU-hour) overrides


@dataclass(frozen=True)
class SimulateResult:
    evaluation: Evaluation
    workload: WorkloadConfig
    autoscaling: AutoscaleOutcome | None = None
    slo_misses: dict | None = None
    engine: str = DEFAULT_ENGINE
    error_bands: dict | None = None  # analysis/error_band.py; None: a measured CPU profile, or it does not fit
    profiled_mode: dict | None = None  # local-cpu: the profiled engine's mode (DeploymentRequest.profiled_mode)

    def to_json(self) -> dict:
        out = {**self.evaluation.to_json(), "workload": workload_json(self.workload), "engine": self.engine}
        if self.error_bands is not None:
            out["error_bands"] = self.error_bands
        if self.profiled_mode is not None:
            out["profiled_mode"] = self.profiled_mode
        if self.autoscaling is not None:
            out["autoscaling"] = self.autoscaling.to_json()
        if self.slo_misses is not None:
            out["slo_misses"] = self.slo_misses
        return out


@dataclass(frozen=True)
class AdviseResult:
    advice: Advice
    workload: WorkloadConfig
    targets: Targets
    engine: str = DEFAULT_ENGINE
    error_bands: dict | None = None  # the recommendation's

    def to_json(self) -> dict:
        out = {**self.advice.to_json(), "workload": workload_json(self.workload), "engine": self.engine}
        if self.error_bands is not None:
            out["error_bands"] = self.error_bands
        return out


@dataclass(frozen=True)
class SweepResult:
    points: list[dict]
    plot: Path
    title: str


def simulate(request: SimulateRequest) -> SimulateResult:
    deployment = request.deployment.build()
    targets = request.targets.build()
    if request.slo_attribution and not targets.slos_ms:
        raise FieldError("{slo_attribution} needs {ttft_target_ms} or {tpot_target_ms}",
                         "slo_attribution", "ttft_target_ms", "tpot_target_ms")
    workload = generate_workload(request.workload)
    outcome = None
    if request.autoscale is not None:
        outcome = evaluate_autoscaling(deployment, workload, targets, request.autoscale.build(),
                                       multi_step=request.multi_step)
        e = outcome.scaled
        if not e.fits:
            outcome = None
    else:
        e = evaluate(deployment, workload, targets, multi_step=request.multi_step)
    misses = None
    if request.slo_attribution and e.fits:
        misses = attribute_slo_misses(e.result, targets.ttft_ms, targets.tpot_ms)
    return SimulateResult(e, request.workload, outcome, misses, request.deployment.engine,
                          request.deployment.error_bands(e), request.deployment.profiled_mode())


def advise(request: AdviseRequest) -> AdviseResult:
    targets = request.targets.build()
    if targets.ttft_ms is None:
        raise FieldError("advise needs {ttft_target_ms} (and optionally {tpot_target_ms})",
                         "ttft_target_ms", "tpot_target_ms")
    if request.max_gpus < 1:
        raise FieldError(f"{{max_gpus}} must be >= 1, got {request.max_gpus}", "max_gpus")
    base = request.deployment.build()
    workload = generate_workload(request.workload)
    advice = advise_deployment(base.model, base.device, workload, targets, base=base, max_gpus=request.max_gpus)
    rec = advice.recommendation
    if request.autoscale is not None and rec is not None:
        outcome = evaluate_autoscaling(rec.deployment, workload, targets, request.autoscale.build())
        if outcome.scaled.fits:
            advice = advice.with_decision(simulated_autoscaling(outcome))
    bands = request.deployment.error_bands(advice.recommendation) if advice.recommendation is not None else None
    return AdviseResult(advice, request.workload, targets, request.deployment.engine, bands)


def sweep(request: SweepRequest) -> SweepResult:
    values = parse_values(request.vary, request.values)
    deployment = request.deployment.build()
    points = run_sweep(deployment, request.workload, request.targets.build(), request.vary, values, request.meter)
    title = f"{deployment.describe()}\n{describe(request.workload)}"
    return SweepResult(points, plot_sweep(points, request.vary, request.meter, request.output, title), title)


@dataclass(frozen=True)
class FrontierResult:
    frontier: "Frontier"
    workload: WorkloadConfig

    def to_json(self) -> dict:
        return {**self.frontier.to_json(), "workload": workload_json(self.workload)}


def frontier(request: FrontierRequest) -> FrontierResult:
    """Every shape of up to max_gpus GPUs of each type (GPU counts in powers of two) x max_num_seqs, priced."""
    from servelab.lab.analysis.frontier import DEFAULT_GPU_COUNTS, LATENCY_METRICS, search
    from servelab.lab.catalog.prices import load_prices

    targets = request.targets.build()
    check = [(targets.ttft_ms is not None, "the frontier needs {ttft_target_ms} (and optionally {tpot_target_ms})",
              ("ttft_target_ms", "tpot_target_ms")),
             (request.max_gpus >= 1, f"{{max_gpus}} must be >= 1, got {request.max_gpus}", ("max_gpus",)),
             (bool(request.gpus), "{gpus} is empty", ("gpus",)),
             (all(n >= 1 for n in request.max_num_seqs) and bool(request.max_num_seqs),
              "{max_num_seqs} must be positive integers", ("max_num_seqs",)),
             (request.latency_metric in LATENCY_METRICS,
              f"{{latency_metric}} must be one of {', '.join(LATENCY_METRICS)}", ("latency_metric",))]
    for ok, template, fields in check:
        if not ok:
            raise FieldError(template, *fields)
    unknown = [g for g in request.gpus if g not in gpu_ids()]
    if unknown:
        raise FieldError(f"{{gpus}}: unknown GPU {unknown[0]!r}; choose from {', '.join(gpu_ids())}", "gpus")
    prices = load_prices(request.prices_file, dict(request.prices))
    bases, skipped = {}, {}
    for gpu in dict.fromkeys(request.gpus):
        try:
            bases[gpu] = replace(request.deployment, gpu=gpu, num_gpus=None, tp=1, disaggregate=None).build()
        except FieldError as err:
            skipped[gpu] = str(err)
    counts = tuple(n for n in DEFAULT_GPU_COUNTS if n <= request.max_gpus) or (request.max_gpus,)
    workload = generate_workload(request.workload)
    requests = {gpu: replace(request.deployment, gpu=gpu) for gpu in bases}
    return FrontierResult(search(bases, prices, workload, targets, counts, request.max_num_seqs,
                                 request.latency_metric, skipped,
                                 lambda e: requests[e.deployment.device.id].error_bands(e)), request.workload)


def workload_json(config: WorkloadConfig) -> dict:
    out = dict(config.__dict__)
    if config.rate_schedule is None:  # answers without a schedule keep their keys
        del out["rate_schedule"]
    if not config.shares_prefixes:  # keys of the prefix-shared dataset only
        del out["prefix_len"], out["num_prefixes"]
    if config.trace is None:  # keys of a replayed trace only
        for key in ("trace", "trace_format", "time_scale", "max_requests", "sample"):
            del out[key]
    out["request_rate"] = "inf" if math.isinf(config.request_rate) else config.request_rate
    return out


def format_json(payload: dict) -> str:
    """The one JSON rendering of a lab answer, shared by `--json` and the web API (byte-identical)."""
    return json.dumps(payload, indent=2) + "\n"
