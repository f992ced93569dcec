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

from servelab.core.request import Request, RequestStatus
from servelab.lab.sim.deployment import Deployment, MemoryPlan, plan_memory
from servelab.lab.sim.instance import Instance
from servelab.lab.sim.load_balancer import LoadBalancer
from servelab.workload import SampledRequest
from servelab.sampling_params import SamplingParams

# Fixed cost of starting one KV transfer (connector handshake, RDMA registration): an assumption,
# of the order NIXL/Mooncake report for small transfers.
KV_TRANSFER_LATENCY_S = 0.5e-3
KV_TRANSFER_EFFICIENCY = 0.8  # achieved share of link bandwidth for large RDMA/NVLink copies

_TRANSFER, _STEP = 0, 1


def prefix_shared_prompt(index: int, w: SampledRequest) -> list[int]:
    """Stand-in token ids that hash as the real prompt would: its group's prefix (the same ids for every
    request of the group), then a suffix no other request has (negative ids, apart from every prefix's)."""
    return [w.prefix_group] * w.prefix_len + [-1 - index] * (w.prompt_len - w.prefix_len)


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
    requests: list[Request]  # finished, in workload order
    kv_transfer_times: list[float] = field(default_factory=list)

    @property
    def duration(self) -> float:
        return max((r.times.finished for r in self.requests), default=0.0)


def simulate(deployment: Deployment, workload: list[SampledRequest], multi_step: bool = True) -> SimulationResult:
    max_tokens = max(w.prompt_len + w.output_len for w in workload)
    memory = plan_memory(deployment, max_tokens)
    if not memory.fits:
        raise DoesNotFit(memory)
    if max_tokens > deployment.model.max_position_embeddings:
        raise ValueError(f"a request of {max_tokens} tokens exceeds {deployment.model.name}'s context of "
                         f"{deployment.model.max_position_embeddings}")
    with _without_cyclic_gc():
        return _Simulation(deployment, workload, memory, multi_step).run()


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
    def __init__(self, d: Deployment, workload: list[SampledRequest], memory: MemoryPlan, multi_step: bool) -> None:
        self.d, self.workload, self.memory = d, workload, memory
        cost_model = d.cost_model()
        roles = (["prefill"] * d.num_prefill_instances + ["decode"] * d.num_decode_instances
                 if d.disaggregated else ["mixed"] * d.num_instances)
        self.instances = [Instance(i, role, d.scheduler_config, memory.num_blocks, d.block_size, cost_model, multi_step,
                                   d.enable_prefix_caching) for i, role in enumerate(roles)]
        self.front = [inst for inst in self.instances if inst.role != "decode"]
        self.back = [inst for inst in self.instances if inst.role == "decode"]
        self.front_balancer = LoadBalancer(d.router, self.front)
        self.back_balancer = LoadBalancer(d.router, self.back)
        self.params = SamplingParams(max_tokens=None, ignore_eos=True)
        self.heap: list[tuple] = []
        self.seq = itertools.count()
        self.finished: dict[int, Request] = {}
        self.transfer_landings: list[float] = []  # min-heap of in-flight KV transfers' landing times
        self.kv_transfer_times: list[float] = []
        # KV crosses NVLink inside a node, the per-GPU NIC between nodes.
        link = (d.device.interconnect_bandwidth_per_direction if d.num_gpus <= d.device.gpus_per_node
                else d.device.network_bandwidth)
        self.transfer_bytes_per_s = link * KV_TRANSFER_EFFICIENCY * d.tensor_parallel_size
        self.kv_bytes_per_token = d.model.kv_bytes_per_token(d.dtype)

    def run(self) -> SimulationResult:
        arrivals, num = self.workload, len(self.workload)
        index = 0
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
            else:
                self._step(payload, time, arrivals[index].arrival_time if index < num else math.inf)
        requests = [self.finished[i] for i in range(num)]
        return SimulationResult(self.d, self.workload, self.memory, self.instances, requests, self.kv_transfer_times)

    def _arrive(self, index: int, time: float) -> None:
        w = self.workload[index]
        instance = self.front_balancer.pick()
        max_tokens = 1 if instance.role == "prefill" else w.output_len
        if w.prefix_group is None:
            request = Request(str(index), [0] * w.prompt_len, self.params, max_tokens, (), time)
        else:
            request = Request(str(index), prefix_shared_prompt(index, w), self.params, max_tokens, (), time,
                              cache_prefix=True)
        instance.add_request(request)
        self._wake(instance, time)

    def _wake(self, instance: Instance, time: float) -> None:
        if not instance.busy:
            instance.busy = True
            heapq.heappush(self.heap, (time, _STEP, next(self.seq), instance))

    def _step(self, instance: Instance, now: float, next_arrival: float) -> None:
        self._retire(instance, instance.pending_finished)
        instance.pending_finished = []
        horizon = self._horizon(instance, next_arrival)
        end = instance.step(now, horizon) if instance.has_unfinished_requests() else None
        # Steps (or runs) that end before the horizon are invisible from outside until then, so the
        # instance carries on without a trip through the heap; so are finishes before the horizon. Not
        # for prefill instances: their finishes pick a decode instance by the others' current load.
        chain = instance.multi_step and instance.role != "prefill"
        while chain and end is not None and end < horizon:
            self._retire(instance, instance.pending_finished)
            instance.pending_finished = []
            if not instance.has_unfinished_requests():
                break
            end = instance.step(end, horizon)
        if end is None or not instance.pending_finished and not instance.has_unfinished_requests():
            instance.busy = False
            instance.next_step_time = math.inf
            if instance.has_unfinished_requests():
                raise RuntimeError(f"instance {instance.index} has requests it can never schedule")
            return
        pending = instance.pending_finished
        if pending:
            self._retire(instance, [r for r in pending if r.times.finished < end])
            instance.pending_finished = [r for r in pending if r.times.finished >= end]
        instance.next_step_time = end
        heapq.heappush(self.heap, (end, _STEP, next(self.seq), instance))

    def _retire(self, instance: Instance, finished: list[Request]) -> None:
        for request in finished:
            instance.num_outstanding -= 1
            self._finish(instance, request, request.times.finished)

    def _horizon(self, instance: Instance, next_arrival: float) -> float:
        """Earliest time a new request could reach the instance: any arrival (the router may pick it),
        or for a decode instance a KV transfer, which lands after some prefill step ends."""
        if instance.role != "decode":
            return next_arrival
        prefill_ends = min(inst.next_step_time for inst in self.front)
        landing = self.transfer_landings[0] if self.transfer_landings else math.inf
        return min(next_arrival, prefill_ends, landing)

    def _finish(self, instance: Instance, request: Request, now: float) -> None:
        index = int(request.request_id)
        w = self.workload[index]
        if instance.role != "prefill" or w.output_len == 1:
            self.finished[index] = request
            return
        # Prefill done: the decode side admits it with the prompt's KV present (num_computed_tokens = prompt_len).
        transfer = KV_TRANSFER_LATENCY_S + w.prompt_len * self.kv_bytes_per_token / self.transfer_bytes_per_s
        target = self.back_balancer.pick()
        handed = Request(request.request_id, request.prompt_token_ids, self.params, w.output_len, (), request.arrival_time,
                         cache_prefix=request.cache_prefix)
        handed.output_token_ids = list(request.output_token_ids)
        handed.num_computed_tokens = w.prompt_len
        handed.num_preemptions = request.num_preemptions
        handed.times = request.times
        handed.times.finished = None
        handed.status = RequestStatus.WAITING
        target.num_outstanding += 1
        self.kv_transfer_times.append(transfer)
        heapq.heappush(self.transfer_landings, now + transfer)
        heapq.heappush(self.heap, (now + transfer, _TRANSFER, next(self.seq), (target, handed)))
