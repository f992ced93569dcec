"""The simulation loop: a workload's requests through a deployment's instances on virtual time.

One event heap keyed by (time, order, sequence number) across all instances: arrivals (kept in their
own sorted list), KV transfers landing on decode instances, and step ends. At equal times arrivals and
transfers come before steps, so a step sees every request that arrived by its start, as the real
engine's loop does. Steps are computed when they start and their finishes take effect at their end.
"""
from __future__ import annotations

import gc
import heapq
import itertools
import math
from contextlib import contextmanager
from dataclasses import dataclass, field

from servelab.core.block_hash import hash_token_blocks
from servelab.core.request import Request, RequestStatus
from servelab.lab.sim.deployment import Deployment, MemoryPlan, plan_memory
from servelab.lab.sim.finished import SimulatedRequest
from servelab.lab.sim.instance import Instance
from servelab.lab.sim.scaling import Autoscaler, Pool, ScaleSample, ScalingConfig
from servelab.trace_formats import MOONCAKE_BLOCK_TOKENS
from servelab.workload import SampledRequest, block_hash_prompt
from servelab.sampling_params import SamplingParams

# Fixed cost of starting one KV transfer (connector handshake, RDMA registration): an assumption,
# of the order NIXL/Mooncake report for small transfers.
KV_TRANSFER_LATENCY_S = 0.5e-3
KV_TRANSFER_EFFICIENCY = 0.8  # achieved share of link bandwidth for large RDMA/NVLink copies

_TRANSFER, _STEP, _READY, _TICK = 0, 1, 2, 3


def prefix_shared_prompt(index: int, w: SampledRequest) -> list[int]:
    """Stand-in token ids that hash as the real prompt would: its group's prefix (the same ids for every
    request of the group), then a suffix no other request has (negative ids, apart from every prefix's)."""
    group = w.prefix_group
    assert group is not None  # called for requests of a prefix group only
    return [group] * w.prefix_len + [-1 - index] * (w.prompt_len - w.prefix_len)


def trace_block_prompt(w: SampledRequest) -> list[int]:
    """Stand-in token ids for a trace's prompt blocks: block hash id h as MOONCAKE_BLOCK_TOKENS tokens of id h,
    so prompts sharing leading hash ids share those cached blocks and no others."""
    return block_hash_prompt(w.block_hash_ids, w.prompt_len, lambda h: [h] * MOONCAKE_BLOCK_TOKENS)


class DoesNotFit(ValueError):
    def __init__(self, memory: MemoryPlan) -> None:
        super().__init__(f"deployment does not fit: {memory.reason}")
        self.memory = memory


@dataclass
class SimulationResult:
    deployment: Deployment
    workload: list[SampledRequest]
    memory: MemoryPlan
    instances: list[Instance]
    requests: list[SimulatedRequest]  # finished, in workload order
    kv_transfer_times: list[float] = field(default_factory=list)
    # Per request (workload order): the instance that finished it, and its KV transfer's seconds (P/D only).
    finished_on: list[int] = field(default_factory=list)
    request_transfer_s: dict[int, float] = field(default_factory=dict)
    # Autoscaled runs: the pools at every scrape.
    scale_samples: list[ScaleSample] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return max((r.times.finished for r in self.requests), default=0.0)  # type: ignore[type-var,return-value]

    def gpu_seconds(self) -> float:
        """GPU time held by the instances: from boot until they were given back, or the end of the run."""
        end = self.duration
        held = sum(max(0.0, (end if i.stopped_at is None else i.stopped_at) - i.started_at) for i in self.instances)
        return held * self.deployment.tensor_parallel_size


def simulate(deployment: Deployment, workload: list[SampledRequest], multi_step: bool = True,
             autoscaler: Autoscaler | None = None, scaling: ScalingConfig | None = None) -> SimulationResult:
    """With an autoscaler (and its scaling limits), each pool starts at the deployment's count, clamped to
    [min_replicas, max_replicas], and changes every autoscaler.interval_s."""
    max_tokens = max(w.prompt_len + w.output_len for w in workload)
    memory = plan_memory(deployment, max_tokens)
    if not memory.fits:
        raise DoesNotFit(memory)
    if max_tokens > deployment.model.max_position_embeddings:
        raise ValueError(f"a request of {max_tokens} tokens exceeds {deployment.model.name}'s context of "
                         f"{deployment.model.max_position_embeddings}")
    with _without_cyclic_gc():
        return _Simulation(deployment, workload, memory, multi_step, autoscaler, scaling or ScalingConfig()).run()


@contextmanager
def _without_cyclic_gc():
    """Pause Python's cyclic garbage collector. A simulation allocates millions of small objects and no
    reference cycles, so the collector's passes over them find nothing and cost a tenth of the run.
    Afterwards the objects go straight to the oldest generation (freeze, then unfreeze) rather than
    all being scanned by the first young collection once it is enabled again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.unfreeze()
        if enabled:
            gc.enable()


class _Simulation:
    def __init__(self, d: Deployment, workload: list[SampledRequest], memory: MemoryPlan, multi_step: bool,
                 autoscaler: Autoscaler | None, scaling: ScalingConfig) -> None:
        self.d, self.workload, self.memory = d, workload, memory
        self.cost_model, self.multi_step = d.cost_model(), multi_step
        self.instances: list[Instance] = []
        self.front: list[Instance] = []  # every prefill-side instance, booting and draining ones too
        counts = ({"prefill": d.num_prefill_instances, "decode": d.num_decode_instances} if d.disaggregated
                  else {"mixed": d.num_instances})
        if autoscaler is not None:
            counts = {role: scaling.clamp(num) for role, num in counts.items()}
        # the prefix router places prompts; KV arriving at a decode pool goes to the least loaded instance
        routers = {role: "least-loaded" if role == "decode" and d.router == "prefix" else d.router for role in counts}
        self.pools = {role: Pool(role, routers[role], self._make_instance, num, memory.num_blocks)
                      for role, num in counts.items()}
        self.front_pool = self.pools["prefill" if d.disaggregated else "mixed"]
        self.back_pool = self.pools.get("decode")
        self.front_balancer = self.front_pool.balancer
        self.back_balancer = self.back_pool.balancer if self.back_pool else None
        self.autoscaler, self.scaling = autoscaler, scaling
        self.next_tick = autoscaler.interval_s if autoscaler else math.inf
        self.num_arrivals_since_tick = 0
        self.scale_samples: list[ScaleSample] = []
        self.finished_on = [0] * len(workload)
        self.request_transfer_s: dict[int, float] = {}
        # greedy, as the engine speculates only for greedy requests (the cost model samples no real token)
        self.params = SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True)
        self.heap: list[tuple] = []
        self.seq = itertools.count()
        self.finished: dict[int, SimulatedRequest] = {}
        # Placeholder prompts of each length, shared: nothing writes a request's prompt token ids.
        self.prompts: dict[int, list[int]] = {}
        self.transfer_landings: list[float] = []  # min-heap of in-flight KV transfers' landing times
        self.ready_times: list[float] = []  # min-heap of when booting replicas join their router
        self.kv_transfer_times: list[float] = []
        # KV crosses NVLink inside a node, the per-GPU NIC between nodes.
        link = (d.device.interconnect_bandwidth_per_direction if d.num_gpus <= d.device.gpus_per_node
                else d.device.network_bandwidth)
        self.transfer_bytes_per_s = link * KV_TRANSFER_EFFICIENCY * d.tensor_parallel_size
        self.transfer_latency_s = KV_TRANSFER_LATENCY_S
        if d.kv_transfer_link is not None:
            self.transfer_latency_s, self.transfer_bytes_per_s = d.kv_transfer_link
        self.kv_bytes_per_token = d.model.kv_bytes_per_token(d.kv_dtype)
        # vLLM's disaggregation proxy (first_token_from_decode) sends a request to the decode instance when the
        # prefill instance's response (max_tokens=1) completes; with asynchronous output processing that
        # response leaves when the prefill instance's next step ends, or at once when it has none to run.
        self.proxy_waits_for_output = d.first_token_from_decode and d.async_output

    def _make_instance(self, role: str, now: float) -> Instance:
        d = self.d
        instance = Instance(len(self.instances), role, d.scheduler_config, self.memory.num_blocks, d.block_size,
                            self.cost_model, self.multi_step, started_at=now,
                            enable_prefix_caching=d.enable_prefix_caching, speculative=d.speculative,
                            spec_acceptance_rate=d.spec_acceptance_rate)
        self.instances.append(instance)
        if role != "decode":
            self.front.append(instance)
        return instance

    def run(self) -> SimulationResult:
        arrivals, num = self.workload, len(self.workload)
        index = 0
        if self.autoscaler is not None:
            heapq.heappush(self.heap, (self.next_tick, _TICK, next(self.seq), None))
        while index < num or self.heap:
            next_arrival = arrivals[index].arrival_time if index < num else math.inf
            if next_arrival <= (self.heap[0][0] if self.heap else math.inf):
                self._arrive(index, next_arrival)
                index += 1
                continue
            time, kind, _, payload = heapq.heappop(self.heap)
            if kind == _TRANSFER:
                heapq.heappop(self.transfer_landings)
                instance, request = payload
                instance.admit_handed_over(request)
                self._wake(instance, time)
            elif kind == _READY:
                heapq.heappop(self.ready_times)
                self.pools[payload.role].mark_ready(payload)
            elif kind == _TICK:
                self._tick(time)
                if index < num or self.heap:
                    self.next_tick = time + self.autoscaler.interval_s  # type: ignore[union-attr]  # ticks need one
                    heapq.heappush(self.heap, (self.next_tick, _TICK, next(self.seq), None))
            else:
                self._step(payload, time, index)
        requests = [self.finished[i] for i in range(num)]
        return SimulationResult(self.d, self.workload, self.memory, self.instances, requests, self.kv_transfer_times,
                                self.finished_on, self.request_transfer_s, self.scale_samples)

    def _tick(self, now: float) -> None:
        for pool in self.pools.values():
            metrics = pool.metrics()
            desired = self.scaling.clamp(self.autoscaler.desired_replicas(metrics, now))  # type: ignore[union-attr]
            if desired > metrics.num_replicas:
                for _ in range(desired - metrics.num_replicas):
                    instance = pool.start(now)
                    heapq.heappush(self.ready_times, now + self.scaling.startup_s)
                    heapq.heappush(self.heap, (now + self.scaling.startup_s, _READY, next(self.seq), instance))
            elif desired < metrics.num_replicas:
                pool.shrink(metrics.num_replicas - desired, now)
            arrivals = self.num_arrivals_since_tick if pool is self.front_pool else 0
            self.scale_samples.append(pool.sample(now, arrivals, desired))
            pool.ttfts.clear()
            pool.tpots.clear()
        self.num_arrivals_since_tick = 0

    def _arrive(self, index: int, time: float) -> None:
        w = self.workload[index]
        self.num_arrivals_since_tick += 1
        max_tokens = 1 if self.d.disaggregated else w.output_len
        if w.block_hash_ids:
            request = Request(str(index), trace_block_prompt(w), self.params, max_tokens, (), time, cache_prefix=True)
        elif w.prefix_group is None:
            prompt = self.prompts.get(w.prompt_len)
            if prompt is None:
                prompt = self.prompts[w.prompt_len] = [0] * w.prompt_len
            request = Request(str(index), prompt, self.params, max_tokens, (), time)
        else:
            request = Request(str(index), prefix_shared_prompt(index, w), self.params, max_tokens, (), time,
                              cache_prefix=True)
        balancer = self.front_balancer
        hashes: list[bytes] = []
        if balancer.needs_block_hashes and request.cache_prefix:
            # the scheduler's prefix lookup reads the same chain from the request: hashed once
            hashes = request.block_hashes = hash_token_blocks(request.prompt_token_ids, self.d.block_size)
        instance: Instance = balancer.pick(hashes)  # type: ignore[assignment]  # its pool's instances
        instance.add_request(request)
        self._wake(instance, time)

    def _wake(self, instance: Instance, time: float) -> None:
        if not instance.busy:
            instance.busy = True
            heapq.heappush(self.heap, (time, _STEP, next(self.seq), instance))

    def _step(self, instance: Instance, now: float, next_index: int) -> None:
        """next_index: the workload's first request that has not arrived yet."""
        scheduler = instance.core.scheduler
        held: list[Request] = []
        if instance.pending_finished:
            if self.proxy_waits_for_output and instance.role == "prefill":
                held = instance.pending_finished
            else:
                self._retire(instance, instance.pending_finished)
            instance.pending_finished = []
        horizon = self._horizon(instance, next_index)
        end = instance.step(now, horizon) if scheduler.waiting or scheduler.running else None
        if held:  # their outputs reach the proxy when the step just started ends (at once if none started)
            self._retire(instance, held, released=now if end is None else end)
        # Steps (or runs) that end before the horizon are invisible from outside until then, so the
        # instance carries on without a trip through the heap; so are finishes before the horizon. Not
        # for prefill instances: their finishes pick a decode instance by the others' current load.
        # (An `if` around the loop: mypyc 2.4 emits broken C for `while chain and end is not None ...`.)
        if instance.multi_step and instance.role != "prefill":
            while end is not None and end < horizon:
                if instance.pending_finished:
                    self._retire(instance, instance.pending_finished)
                    instance.pending_finished = []
                if not (scheduler.waiting or scheduler.running):  # Instance.has_unfinished_requests()
                    break
                end = instance.step(end, horizon)
        if end is None or not instance.pending_finished and not instance.has_unfinished_requests():
            instance.busy = False
            instance.next_step_time = math.inf
            if instance.has_unfinished_requests():
                raise RuntimeError(f"instance {instance.index} has requests it can never schedule")
            if instance.draining_since is not None:
                self.pools[instance.role].stop_if_drained(instance, now)
            return
        pending = instance.pending_finished
        if pending:
            self._retire(instance, [r for r in pending if r.times.finished < end])  # type: ignore[operator]
            instance.pending_finished = [r for r in pending if r.times.finished >= end]  # type: ignore[operator]
        instance.next_step_time = end
        heapq.heappush(self.heap, (end, _STEP, next(self.seq), instance))

    def _retire(self, instance: Instance, finished: list[Request], released: float | None = None) -> None:
        instance.num_outstanding -= len(finished)
        for request in finished:
            self._finish(instance, request, request.times.finished, released)  # type: ignore[arg-type]  # finished: set

    def _horizon(self, instance: Instance, next_index: int) -> float:
        """Earliest time a new request could reach the instance: the next arrival the router may send
        it, or for a decode instance a KV transfer, which lands after some prefill step ends (or after a
        step an arrival starts on an idle prefill instance)."""
        # An autoscaler's scrape reads every instance's gauges, so runs stop there too.
        if instance.role != "decode":
            arrival = self._next_arrival_for(instance, next_index)
            return self.next_tick if self.next_tick < arrival else arrival
        prefill_ends = min(inst.next_step_time for inst in self.front)
        landing = self.transfer_landings[0] if self.transfer_landings else math.inf
        return min(self._arrival_time(next_index), prefill_ends, landing, self.next_tick)

    def _next_arrival_for(self, instance: Instance, next_index: int) -> float:
        """When the next request the router sends to instance arrives, as far as it is known now. A
        round-robin router's turns are fixed until its instances change: at a scrape (a horizon anyway)
        or when a booting replica joins. A least-loaded router picks by every instance's load at the
        time, so any arrival may be this instance's."""
        balancer = self.front_balancer
        if not balancer.picks_in_turn:
            return self._arrival_time(next_index)
        if instance not in balancer.instances:  # draining: the router sends it nothing more
            return math.inf
        joins = self.ready_times[0] if self.ready_times else math.inf
        arrival = self._arrival_time(next_index + balancer.picks_before(instance))
        return joins if joins < arrival else arrival

    def _arrival_time(self, index: int) -> float:
        return self.workload[index].arrival_time if index < len(self.workload) else math.inf

    def _finish(self, instance: Instance, request: Request, now: float, released: float | None = None) -> None:
        """released: when the prefill's output reached the disaggregation proxy, which only then sends the
        request to the decode side (None: when the prefill ended)."""
        index = int(request.request_id)
        w = self.workload[index]
        if instance.role != "prefill" or w.output_len == 1:
            async_from = (1 if self.d.first_token_from_decode else 0) if self.d.async_output else None
            self.finished[index] = SimulatedRequest.of(request, instance.step_stats.timeline, async_from,
                                                       busy=instance.num_outstanding > 0)
            self.finished_on[index] = instance.index
            if self.autoscaler is not None:
                self._observe(request, w.output_len)
            return
        # Prefill done: the decode side admits it with the prompt's KV present (num_computed_tokens = prompt_len).
        transfer = self.transfer_latency_s + w.prompt_len * self.kv_bytes_per_token / self.transfer_bytes_per_s
        target = self.back_balancer.pick()  # type: ignore[union-attr]  # disaggregated: a decode pool
        handed = Request(request.request_id, request.prompt_token_ids, self.params, w.output_len, (), request.arrival_time,
                         cache_prefix=request.cache_prefix)
        handed.output_token_ids = list(request.output_token_ids)
        handed.num_computed_tokens = w.prompt_len
        handed.num_preemptions = request.num_preemptions
        handed.times = request.times
        handed.times.finished = None
        handed.status = RequestStatus.WAITING
        target.num_outstanding += 1
        # The KV leaves when the prefill step ends; the decode side takes the request once the proxy sends it.
        landing = now + transfer if released is None or released < now + transfer else released
        self.kv_transfer_times.append(transfer)
        self.request_transfer_s[index] = landing - now
        heapq.heappush(self.transfer_landings, landing)
        heapq.heappush(self.heap, (landing, _TRANSFER, next(self.seq), (target, handed)))

    def _observe(self, request: Request, output_len: int) -> None:
        times = request.times
        self.front_pool.ttfts.append(times.first_token - times.arrival)  # type: ignore[operator]  # finished: set
        if output_len > 1:
            (self.back_pool or self.front_pool).tpots.append(
                (times.finished - times.first_token) / (output_len - 1))  # type: ignore[operator]
