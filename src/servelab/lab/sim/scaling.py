"""The simulator's side of autoscaling: pools of instances that grow and shrink while requests run.

A pool is the replicas of one role ("mixed", or "prefill" and "decode" scaled separately). Every interval the
simulation reads each pool's metrics (what a Prometheus scrape of vLLM would give) and asks the autoscaler
(a policy from lab/analysis) for a replica count. A new replica boots for startup_s before the router sees it;
a removed one leaves the router at once and drains: it finishes what it holds and only then gives its GPUs back,
so no request is lost.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Protocol

from servelab.errors import check_fields
from servelab.lab.sim.instance import Instance
from servelab.lab.sim.load_balancer import LoadBalancer


@dataclass(frozen=True)
class ScalingConfig:
    min_replicas: int = 1
    max_replicas: int = 8
    startup_s: float = 120.0  # model load, CUDA graph capture, warm-up: what a new replica costs before it serves

    def __post_init__(self) -> None:
        check_fields([
            (1 <= self.min_replicas <= self.max_replicas,
             "need 1 <= {min_replicas} <= {max_replicas}", ("min_replicas", "max_replicas")),
            (self.startup_s >= 0, "{startup_s} must be >= 0", ("startup_s",)),
        ])

    def clamp(self, num: int) -> int:
        return min(self.max_replicas, max(self.min_replicas, num))


@dataclass(frozen=True)
class PoolMetrics:
    """One pool at one scrape: gauges averaged over its serving replicas; latencies are means over the
    requests that finished in the last interval (None when none did)."""
    role: str
    num_ready: int
    num_starting: int
    num_waiting: float  # vllm:num_requests_waiting, per serving replica
    kv_usage: float  # vllm:kv_cache_usage_perc, mean over serving replicas
    mean_ttft_s: float | None
    mean_tpot_s: float | None

    @property
    def num_replicas(self) -> int:
        return self.num_ready + self.num_starting


class Autoscaler(Protocol):
    interval_s: float  # between scrapes: KEDA's pollingInterval, Dynamo's adjustment_interval

    def desired_replicas(self, metrics: PoolMetrics, now: float) -> int: ...


@dataclass(frozen=True, slots=True)
class ScaleSample:
    """The deployment at one scrape, for plots over time."""
    time: float
    role: str
    num_arrivals: int  # requests that arrived at the deployment in the last interval
    num_ready: int
    num_starting: int
    num_draining: int
    num_waiting: int
    num_running: int
    kv_usage: float
    desired: int


class Pool:
    def __init__(self, role: str, router: str, make_instance: Callable[[str, float], Instance],
                 num_initial: int, capacity_blocks: int = 1) -> None:
        self.role = role
        self.make_instance = make_instance
        self.balancer = LoadBalancer(router, [make_instance(role, 0.0) for _ in range(num_initial)], capacity_blocks)
        self.starting: list[Instance] = []
        self.draining: list[Instance] = []
        self.ttfts: list[float] = []  # finished in the current interval
        self.tpots: list[float] = []

    @property
    def ready(self) -> list[Instance]:
        return self.balancer.instances

    def metrics(self) -> PoolMetrics:
        ready = self.ready
        n = len(ready)
        return PoolMetrics(
            role=self.role, num_ready=n, num_starting=len(self.starting),
            num_waiting=sum(i.core.scheduler.num_waiting for i in ready) / n,
            kv_usage=sum(i.core.scheduler.block_manager.usage for i in ready) / n,
            # fsum: exact whatever the order the instances' finishes were recorded in
            mean_ttft_s=math.fsum(self.ttfts) / len(self.ttfts) if self.ttfts else None,
            mean_tpot_s=math.fsum(self.tpots) / len(self.tpots) if self.tpots else None)

    def start(self, now: float) -> Instance:
        instance = self.make_instance(self.role, now)
        self.starting.append(instance)
        return instance

    def mark_ready(self, instance: Instance) -> bool:
        """False when the instance was cancelled while it booted."""
        if instance not in self.starting:
            return False
        self.starting.remove(instance)
        self.balancer.add(instance)
        return True

    def shrink(self, num: int, now: float) -> None:
        """Cancel booting replicas first (newest first), then drain the serving ones holding least."""
        while num and self.starting:
            self.starting.pop().stopped_at = now
            num -= 1
        for _ in range(num):
            victim = min(reversed(self.ready), key=lambda inst: inst.num_outstanding)
            self.balancer.remove(victim)
            victim.draining_since = now
            self.draining.append(victim)
            self.stop_if_drained(victim, now)

    def stop_if_drained(self, instance: Instance, now: float) -> None:
        if instance.draining_since is not None and instance.stopped_at is None and instance.num_outstanding == 0 \
                and not instance.busy:
            # an idle instance's clock stands at the end of its last step, which may be after the caller's now
            instance.stopped_at = max(now, instance.core.clock.now())
            self.draining.remove(instance)

    def sample(self, now: float, num_arrivals: int, desired: int) -> ScaleSample:
        live = self.ready + self.draining
        return ScaleSample(
            time=now, role=self.role, num_arrivals=num_arrivals, num_ready=len(self.ready),
            num_starting=len(self.starting), num_draining=len(self.draining),
            num_waiting=sum(i.core.scheduler.num_waiting for i in live),
            num_running=sum(i.core.scheduler.num_running for i in live),
            kv_usage=sum(i.core.scheduler.block_manager.usage for i in self.ready) / len(self.ready),
            desired=desired)
