"""Autoscaling over time, simulated: one workload through an autoscaled deployment and through a fixed one sized
for the peak (max_replicas), compared on SLO attainment and GPU-hours, with the pools' gauges over time."""
from __future__ import annotations

from dataclasses import dataclass, replace

from servelab.lab.analysis.autoscale_policies import AutoscalePolicyConfig, make_autoscaler
from servelab.lab.analysis.evaluate import Evaluation, Targets, evaluate
from servelab.lab.sim.deployment import Deployment
from servelab.lab.sim.scaling import ScalingConfig
from servelab.lab.sim.simulate import SimulationResult
from servelab.workload import SampledRequest

POLICY_NAMES = {"keda": "KEDA (HPA formula) on vLLM metrics", "dynamo": "Dynamo planner (load-based)"}


@dataclass(frozen=True)
class AutoscaleSettings:
    policy: AutoscalePolicyConfig
    scaling: ScalingConfig

    def to_json(self) -> dict:
        p, s = self.policy, self.scaling
        return {"policy": p.policy, "min_replicas": s.min_replicas, "max_replicas": s.max_replicas,
                "startup_s": s.startup_s, "cooldown_s": p.cooldown_s, "interval_s": p.interval_s,
                "target_waiting": p.target_waiting, "target_kv_usage": p.target_kv_usage}


@dataclass
class AutoscaleOutcome:
    settings: AutoscaleSettings
    scaled: Evaluation
    fixed: Evaluation
    targets: Targets

    def to_json(self) -> dict:
        scaled, fixed = self.scaled.result, self.fixed.result
        out = {"settings": self.settings.to_json(),
               "autoscaled": _summary(self.scaled, self.targets),
               "fixed": _summary(self.fixed, self.targets),
               "timeline": timeline(scaled, self.settings.policy.interval_s),
               "decision": self.decision()}
        out["gpu_hours_saved_share"] = (1 - scaled.gpu_seconds() / fixed.gpu_seconds()) if fixed.gpu_seconds() else 0.0
        return out

    def summaries(self) -> tuple[dict, dict]:
        """The autoscaled run's and the fixed deployment's GPU-hours, replicas, SLO attainment and latencies."""
        return _summary(self.scaled, self.targets), _summary(self.fixed, self.targets)

    def replica_range(self) -> tuple[int, int]:
        """Fewest and most serving replicas (every pool's together) the autoscaler kept at any scrape."""
        by_time: dict[float, int] = {}
        for s in self.scaled.result.scale_samples:
            by_time[s.time] = by_time.get(s.time, 0) + s.num_ready
        if not by_time:  # the run ended before the first scrape
            num = len(self.scaled.result.instances)
            return num, num
        return min(by_time.values()), max(by_time.values())

    def decision(self) -> str:
        s, f = self.summaries()
        cfg = self.settings.scaling
        att = "" if s["slo_attainment"] is None else (
            f" with {s['slo_attainment']:.1%} of requests meeting the targets (fixed: {f['slo_attainment']:.1%})")
        return (f"{POLICY_NAMES[self.settings.policy.policy]} between {cfg.min_replicas} and {cfg.max_replicas} "
                f"replicas used {s['gpu_hours']:,.1f} GPU-hours against {f['gpu_hours']:,.1f} for a fixed "
                f"{f['num_replicas_peak']} replicas{att}; p99 TTFT {s['p99_ttft_ms']:,.0f} ms vs "
                f"{f['p99_ttft_ms']:,.0f} ms")


def evaluate_autoscaling(deployment: Deployment, workload: list[SampledRequest], targets: Targets,
                         settings: AutoscaleSettings, multi_step: bool = True) -> AutoscaleOutcome:
    policy = replace(settings.policy,
                     ttft_target_s=targets.ttft_ms / 1000 if targets.ttft_ms else None,
                     tpot_target_s=targets.tpot_ms / 1000 if targets.tpot_ms else None)
    scaled = evaluate(deployment, workload, targets, multi_step=multi_step, autoscaler=make_autoscaler(policy),
                      scaling=settings.scaling)
    fixed = evaluate(peak_deployment(deployment, settings.scaling.max_replicas), workload, targets,
                     multi_step=multi_step)
    return AutoscaleOutcome(settings, scaled, fixed, targets)


def peak_deployment(d: Deployment, max_replicas: int) -> Deployment:
    """The fixed deployment an autoscaler's maximum stands for: max_replicas of every pool."""
    tp = d.tensor_parallel_size
    if d.disaggregated:
        return replace(d, num_gpus=2 * max_replicas * tp, num_prefill_instances=max_replicas,
                       num_decode_instances=max_replicas)
    return replace(d, num_gpus=max_replicas * tp)


def _summary(e: Evaluation, targets: Targets) -> dict:
    r = e.result
    m = e.metrics
    return {"gpu_hours": r.gpu_seconds() / 3600, "duration_s": r.duration,
            "num_replicas_peak": _peak_replicas(r), "num_instances_started": len(r.instances),
            "slo_attainment": m.get("slo_attainment") if targets.slos_ms else None,
            "p99_ttft_ms": m["p99_ttft_ms"], "p99_tpot_ms": m["p99_tpot_ms"], "num_requests": len(r.requests)}


def _peak_replicas(r: SimulationResult) -> int:
    if not r.scale_samples:
        return len(r.instances)
    by_time: dict[float, int] = {}
    for s in r.scale_samples:
        by_time[s.time] = by_time.get(s.time, 0) + s.num_ready + s.num_starting + s.num_draining
    return max(by_time.values())


def timeline(r: SimulationResult, interval_s: float) -> dict:
    """Per role, columns over scrape times: the load (arrival rate), gauges and replica counts."""
    out = {}
    for role in dict.fromkeys(s.role for s in r.scale_samples):
        samples = [s for s in r.scale_samples if s.role == role]
        out[role] = {
            "time_s": [s.time for s in samples],
            "arrival_rate": [s.num_arrivals / interval_s for s in samples],
            "num_waiting": [s.num_waiting for s in samples],
            "num_running": [s.num_running for s in samples],
            "kv_usage": [round(s.kv_usage, 4) for s in samples],
            "num_ready": [s.num_ready for s in samples],
            "num_starting": [s.num_starting for s in samples],
            "num_draining": [s.num_draining for s in samples],
            "desired": [s.desired for s in samples],
        }
    return out

