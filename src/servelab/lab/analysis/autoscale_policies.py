"""Autoscaling policies as deployed autoscalers apply them to vLLM's metrics.

keda: KEDA's Prometheus scaler on vllm:num_requests_waiting and vllm:kv_cache_usage_perc (the vLLM production
  stack's and KServe's setup) drives a Kubernetes HorizontalPodAutoscaler, which computes, per metric,
  desiredReplicas = ceil(currentReplicas * currentMetricValue / desiredMetricValue), takes the largest, skips
  changes within its 10% tolerance, and scales down only to the highest recommendation of the last
  stabilization window (scaleDown.stabilizationWindowSeconds, 300 s by default; here the cool-down).
  https://kubernetes.io/docs/tasks/run-application/horizontal-pod-autoscale/#algorithm-details
  https://docs.vllm.ai/projects/production-stack/en/latest/use_cases/autoscaling-keda.html
  A TTFT or TPOT target adds one more metric, the interval's mean latency over its target.
dynamo: NVIDIA Dynamo's load-based planner: every adjustment interval it compares the prefill queue per prefill
  worker and the mean KV-cache utilization of decode (or aggregated) workers with thresholds and adds or
  removes one worker, never while a change is under way ("to avoid over-compensation").
  https://docs.nvidia.com/dynamo/latest/architecture/planner.html
  Dynamo's SLA planner scales on the interval's mean TTFT and ITL; here a missed target scales up by one too.
  Scale-down waits for the cool-down after the pool's last change.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from servelab.errors import check_fields
from servelab.lab.sim.scaling import PoolMetrics

POLICIES = ("keda", "dynamo")
HPA_TOLERANCE = 0.1  # kube-controller-manager --horizontal-pod-autoscaler-tolerance
# Dynamo's load-based planner defaults: scale decode up above 0.9 KV utilization, down below 0.5; prefill up
# above 5 queued requests per worker, down below 0.2.
DYNAMO_DOWN_KV_FRACTION = 0.5 / 0.9
DYNAMO_DOWN_WAITING = 0.2


@dataclass(frozen=True)
class AutoscalePolicyConfig:
    policy: str = "keda"
    interval_s: float = 30.0
    cooldown_s: float = 300.0
    target_waiting: float = 5.0  # num_requests_waiting per replica
    target_kv_usage: float = 0.8  # kv_cache_usage_perc
    ttft_target_s: float | None = None
    tpot_target_s: float | None = None

    def __post_init__(self) -> None:
        check_fields([
            (self.policy in POLICIES, f"{{autoscale}} must be one of {', '.join(POLICIES)}", ("autoscale",)),
            (self.interval_s > 0, "{interval_s} must be > 0", ("interval_s",)),
            (self.cooldown_s >= 0, "{cooldown_s} must be >= 0", ("cooldown_s",)),
            (self.target_waiting > 0, "{target_waiting} must be > 0", ("target_waiting",)),
            (0 < self.target_kv_usage <= 1, "{target_kv_usage} must be in (0, 1]", ("target_kv_usage",)),
        ])


def make_autoscaler(config: AutoscalePolicyConfig):
    return KedaHpa(config) if config.policy == "keda" else DynamoPlanner(config)


class KedaHpa:
    def __init__(self, config: AutoscalePolicyConfig) -> None:
        self.config = config
        self.interval_s = config.interval_s
        self._recommendations: dict[str, deque[tuple[float, int]]] = {}

    def ratios(self, m: PoolMetrics) -> list[float]:
        c = self.config
        ratios = []
        if m.role != "decode":
            ratios.append(m.num_waiting / c.target_waiting)
        if m.role != "prefill":
            ratios.append(m.kv_usage / c.target_kv_usage)
        if c.ttft_target_s and m.role != "decode" and m.mean_ttft_s is not None:
            ratios.append(m.mean_ttft_s / c.ttft_target_s)
        if c.tpot_target_s and m.role != "prefill" and m.mean_tpot_s is not None:
            ratios.append(m.mean_tpot_s / c.tpot_target_s)
        return ratios

    def desired_replicas(self, m: PoolMetrics, now: float) -> int:
        current = m.num_replicas
        ratio = max(self.ratios(m))
        # serving replicas carry the load; booting ones count toward the current size, as in the HPA
        proposal = current if abs(ratio - 1) <= HPA_TOLERANCE else math.ceil(m.num_ready * ratio)
        window = self._recommendations.setdefault(m.role, deque())
        window.append((now, proposal))
        while window[0][0] < now - self.config.cooldown_s:
            window.popleft()
        if proposal >= current:
            return proposal
        return min(current, max(p for _, p in window))


class DynamoPlanner:
    def __init__(self, config: AutoscalePolicyConfig) -> None:
        self.config = config
        self.interval_s = config.interval_s
        self._last_change: dict[str, float] = {}

    def desired_replicas(self, m: PoolMetrics, now: float) -> int:
        c = self.config
        current = m.num_replicas
        if m.num_starting:  # the planner blocks adjustment while workers are being added
            return current
        up, down = [], []
        if m.role != "decode":
            up.append(m.num_waiting > c.target_waiting)
            down.append(m.num_waiting < DYNAMO_DOWN_WAITING)
        if m.role != "prefill":
            up.append(m.kv_usage > c.target_kv_usage)
            down.append(m.kv_usage < c.target_kv_usage * DYNAMO_DOWN_KV_FRACTION)
        for latency, target, side in ((m.mean_ttft_s, c.ttft_target_s, "decode"),
                                      (m.mean_tpot_s, c.tpot_target_s, "prefill")):
            if target and latency is not None and m.role != side:
                up.append(latency > target)
                down.append(latency < target * DYNAMO_DOWN_KV_FRACTION)
        last = self._last_change.get(m.role, -math.inf)
        if any(up):
            desired = current + 1
        elif all(down) and now - last >= c.cooldown_s:
            desired = current - 1
        else:
            return current
        self._last_change[m.role] = now
        return desired
