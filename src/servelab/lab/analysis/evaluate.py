"""One lab question answered: a deployment under a workload -> {"deployment", "meters", "metrics"}."""
from __future__ import annotations

from dataclasses import dataclass

from servelab.lab.sim.deployment import Deployment
from servelab.lab.analysis.meters import compute_meters, request_timings
from servelab.metrics.request_stats import compute_metrics
from servelab.lab.sim.scaling import Autoscaler, ScalingConfig
from servelab.lab.sim.simulate import DoesNotFit, SimulationResult, simulate
from servelab.workload import SampledRequest


@dataclass(frozen=True)
class Targets:
    ttft_ms: float | None = None
    tpot_ms: float | None = None

    @property
    def slos_ms(self) -> dict[str, float]:
        return {k: v for k, v in (("ttft", self.ttft_ms), ("tpot", self.tpot_ms)) if v is not None}

    def met_by(self, metrics: dict) -> bool:
        """A target is met when the p99 meets it (99% of requests)."""
        return all(metrics.get(f"p99_{key}_ms", float("inf")) <= limit for key, limit in self.slos_ms.items())


@dataclass
class Evaluation:
    deployment: Deployment
    fits: bool
    meters: dict
    metrics: dict
    meets_targets: bool
    result: SimulationResult | None = None
    reason: str = ""

    def to_json(self) -> dict:
        out = {"deployment": self.deployment.to_json(), "fits": self.fits}
        if not self.fits:
            out["reason"] = self.reason
        out["meters"] = self.meters
        out["metrics"] = self.metrics
        return out


def evaluate(deployment: Deployment, workload: list[SampledRequest], targets: Targets = Targets(),
             multi_step: bool = True, autoscaler: Autoscaler | None = None,
             scaling: ScalingConfig | None = None) -> Evaluation:
    try:
        result = simulate(deployment, workload, multi_step=multi_step, autoscaler=autoscaler, scaling=scaling)
    except DoesNotFit as err:
        m = err.memory
        weights = {"bytes_per_gpu": m.weight_bytes, "share_of_memory": m.weight_bytes / m.memory_bytes,
                   "kv_cache_bytes_per_gpu": m.kv_cache_bytes, "memory_bytes": m.memory_bytes,
                   "usable_bytes": m.usable_bytes, "activation_bytes": m.activation_bytes,
                   "max_request_tokens": m.max_request_tokens, "kv_cache_tokens": m.num_blocks * deployment.block_size,
                   "bottleneck": True}
        return Evaluation(deployment, False, {"weights": weights}, {}, False, reason=m.reason)
    timings = request_timings(result)
    # the client's clock: the last response ends after the API server's closing work
    duration = max((t.finished for t in timings), default=0.0)
    metrics = compute_metrics(timings, duration, targets.slos_ms)
    meters = compute_meters(result, metrics, targets.ttft_ms, targets.tpot_ms)
    return Evaluation(deployment, True, meters, metrics, targets.met_by(metrics), result)
