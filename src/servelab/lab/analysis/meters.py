"""The lab's meters, computed from each instance's StepStats (what its EngineCore sent to the stats sink,
one per step or decode run) and request timestamps. Each meter says whether it is a bottleneck, by the
named thresholds below (teaching rules of thumb)."""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from servelab.executor.cost_model import CostModel
from servelab.metrics.request_stats import RequestTiming
from servelab.lab.sim.api_path import client_timings
from servelab.lab.sim.simulate import SimulationResult
from servelab.lab.sim.step_log import BREAKDOWN_KEYS, StepLog

KV_PRESSURE = 0.90  # peak share of the block pool in use
WEIGHTS_SHARE_LIMIT = 0.75  # weights leave too little of a GPU for KV
CAPACITY_LIMIT = 0.90  # demanded decode tokens/s over the deployment's maximum
SLOTS_FULL_SHARE = 0.25  # share of time with every batch slot taken while requests wait
QUEUE_SHARE_OF_TTFT = 0.50  # waiting to be scheduled is most of TTFT
COMMUNICATION_SHARE = 0.30  # all-reduces take this much of step time
NUM_SERIES_POINTS = 40


@dataclass
class StepColumns:
    """One instance's StepStats as columns, in step order. Means and peaks of the states after each step,
    those of a decode run taken from its RunStates: what single steps would give (waiting stays put
    during a run). The batch is full (max_num_seqs running) for peak_running_s of an entry at most."""
    role: str
    starts: Sequence[float]
    durations: Sequence[float]
    running: Sequence[float]
    peak_running: Sequence[int]
    peak_running_s: Sequence[float]
    waiting: Sequence[int]
    kv_usage: Sequence[float]
    peak_kv_usage: Sequence[float]
    reserved_unused: Sequence[float]

    @classmethod
    def of(cls, role: str, log: StepLog) -> "StepColumns":
        return cls(role, *map(log.column, ("start", "duration", "mean_running", "peak_running", "peak_running_s",
                                           "num_waiting", "mean_kv_usage", "peak_kv_usage",
                                           "mean_reserved_unused_slots")))


def breakdown_totals(log: StepLog, cost_model: CostModel) -> dict[str, float]:
    """Seconds spent per cost component over a run. A step carries its breakdown; a priced decode run
    (which has none) its (steps, batch size) segments, priced here by the parts that do not depend on
    context length, attention taking the rest of its duration. Sums run in step order."""
    totals = dict.fromkeys(BREAKDOWN_KEYS, 0.0)
    for _, breakdown in log.breakdowns_in_order():
        for key, value in breakdown.items():
            totals[key] += value
    steps_by_batch: dict[int, int] = {}
    for count, batch_size in log.segments_in_order():
        steps_by_batch[batch_size] = steps_by_batch.get(batch_size, 0) + count
    run_time = 0.0
    durations = log.column("duration")
    for index in log.run_indices():
        run_time += durations[index]
    fixed = 0.0
    for batch_size, count in steps_by_batch.items():
        for key, value in cost_model.decode_breakdown(batch_size).items():
            totals[key] += value * count
            fixed += value * count
    totals["attention"] += run_time - fixed
    return totals


def request_timings(result: SimulationResult) -> list[RequestTiming]:
    """As a benchmark client sees them (the API server's work and multi-step waits included)."""
    return client_timings(result.deployment, result.requests)


def _weighted_mean(values: list, durations: list, total: float) -> float:
    return float(np.dot(values, durations) / total) if total > 0 and values else 0.0


def compute_meters(result: SimulationResult, metrics: dict, ttft_target_ms: float | None = None,
                   tpot_target_ms: float | None = None) -> dict:
    d, mem = result.deployment, result.memory
    duration = result.duration
    cost_model = d.cost_model()
    instances = [StepColumns.of(inst.role, inst.step_stats) for inst in result.instances]
    serving = [inst for inst in instances if inst.role != "prefill"]
    max_seqs = d.scheduler_config.effective_max_num_seqs
    pool_slots = mem.num_blocks * d.block_size
    requests = result.requests
    num_preemptions = sum(r.num_preemptions for r in requests)

    usage = [_weighted_mean(i.kv_usage, i.durations, duration) for i in instances]
    peak_usage = max((max(i.peak_kv_usage, default=0.0) for i in instances), default=0.0)
    kv = {"num_blocks": mem.num_blocks, "block_size": d.block_size, "peak_usage": peak_usage,
          "mean_usage": float(np.mean(usage)), "num_preemptions": num_preemptions}
    if d.scheduler_config.contiguous:
        # share of the slots held by reservations that hold no KV
        unused = sum(float(np.dot(i.reserved_unused, i.durations)) for i in instances)
        held = sum(float(np.dot(i.kv_usage, i.durations)) for i in instances) * pool_slots
        kv["reserved_unused_share"] = unused / held if held else 0.0
    kv["bottleneck"] = peak_usage >= KV_PRESSURE or num_preemptions > 0

    weight_share = mem.weight_bytes / mem.memory_bytes
    weights = {"bytes_per_gpu": mem.weight_bytes, "share_of_memory": weight_share,
               "kv_cache_bytes_per_gpu": mem.kv_cache_bytes, "bottleneck": weight_share >= WEIGHTS_SHARE_LIMIT}

    decode = _decode_capacity(result, metrics, cost_model, serving, max_seqs, pool_slots)
    slots = _batch_slots(result, serving, max_seqs, duration)

    ttft_ms = np.array([(r.times.first_token - r.arrival_time) * 1000 for r in requests])
    ttft = {"median_ms": metrics["median_ttft_ms"], "p99_ms": metrics["p99_ttft_ms"], "target_ms": ttft_target_ms,
            "attainment": float(np.mean(ttft_ms <= ttft_target_ms)) if ttft_target_ms else None,
            "bottleneck": bool(ttft_target_ms and metrics["p99_ttft_ms"] > ttft_target_ms)}
    tpot = {"median_ms": metrics["median_tpot_ms"], "p99_ms": metrics["p99_tpot_ms"], "target_ms": tpot_target_ms,
            "bottleneck": bool(tpot_target_ms and metrics["p99_tpot_ms"] > tpot_target_ms)}
    goodput = {"requests_per_s": metrics.get("request_goodput", metrics["request_throughput"]),
               "slo_attainment": metrics.get("slo_attainment", 1.0)}
    goodput["bottleneck"] = goodput["slo_attainment"] < 0.99
    preemptions = {"count": num_preemptions, "requests_preempted": sum(1 for r in requests if r.num_preemptions),
                   "bottleneck": num_preemptions > 0}

    meters = {"kv_cache": kv, "weights": weights, "decode_throughput": decode, "batch_slots": slots,
              "ttft": ttft, "tpot": tpot, "goodput": goodput, "preemptions": preemptions,
              "queue": _queue(result, instances, metrics, duration),
              "step_time": _step_time(result, cost_model)}
    queries = sum(inst.core.scheduler.prefix_cache_queries_total for inst in result.instances)
    if queries:  # only requests of a prefix-shared workload take part: other answers keep their keys
        hits = sum(inst.core.scheduler.prefix_cache_hits_total for inst in result.instances)
        meters["prefix_cache"] = {"queried_tokens": queries, "hit_tokens": hits, "hit_rate": hits / queries,
                                  "bottleneck": False}
    if d.disaggregated:
        times = np.array(result.kv_transfer_times) * 1000
        share = float(times.mean() / metrics["mean_ttft_ms"]) if times.size and metrics["mean_ttft_ms"] else 0.0
        meters["kv_transfer"] = {"mean_ms": float(times.mean()) if times.size else 0.0,
                                 "p99_ms": float(np.percentile(times, 99)) if times.size else 0.0,
                                 "share_of_ttft": share, "bottleneck": share >= QUEUE_SHARE_OF_TTFT}
    return meters


def _decode_capacity(result, metrics, cost, serving, max_seqs, pool_slots) -> dict:
    """Most decode tokens/s the deployment can give: the largest batch the slots and the KV pool allow
    at the workload's mean context, priced by the cost model."""
    w = result.workload
    mean_output = float(np.mean([x.output_len for x in w]))
    mean_context = float(np.mean([x.prompt_len for x in w])) + mean_output / 2
    batch = max(1, min(max_seqs, int(pool_slots / max(mean_context, 1.0))))
    capacity = len(serving) * batch / cost.decode_step_time(batch, mean_context)
    span = w[-1].arrival_time - w[0].arrival_time
    rate = (len(w) - 1) / span if span > 0 else None
    demanded = rate * mean_output if rate else None
    utilization = (demanded if demanded is not None else metrics["output_throughput"]) / capacity
    return {"demanded_tokens_per_s": demanded, "served_tokens_per_s": metrics["output_throughput"],
            "capacity_tokens_per_s": capacity, "max_batch": batch, "utilization": utilization,
            "bottleneck": utilization >= CAPACITY_LIMIT}


def _batch_slots(result, serving, max_seqs, duration) -> dict:
    full = sum(dur for inst in serving for dur, run, wait in zip(inst.peak_running_s, inst.peak_running, inst.waiting)
               if run >= max_seqs and wait > 0)
    mean_running = float(np.mean([_weighted_mean(i.running, i.durations, duration) for i in serving]))
    full_share = full / (duration * len(serving)) if duration > 0 else 0.0
    return {"max_num_seqs": max_seqs, "mean_running": mean_running,
            "peak_running": max((max(i.peak_running, default=0) for i in serving), default=0),
            "mean_saturation": mean_running / max_seqs, "full_with_waiting_share": full_share,
            "bottleneck": full_share >= SLOTS_FULL_SHARE}


def _queue(result, instances, metrics, duration) -> dict:
    queue_ms = np.array([(r.times.first_scheduled - r.arrival_time) * 1000 for r in result.requests])
    mean_queue = float(queue_ms.mean()) if queue_ms.size else 0.0
    share = mean_queue / metrics["mean_ttft_ms"] if metrics["mean_ttft_ms"] > 0 else 0.0
    series = []
    for k in range(NUM_SERIES_POINTS):
        t = duration * (k + 0.5) / NUM_SERIES_POINTS
        series.append([t, sum(_value_at(i.starts, i.durations, i.waiting, t) for i in instances)])
    return {"mean_waiting": sum(_weighted_mean(i.waiting, i.durations, duration) for i in instances),
            "peak_waiting": max((max(i.waiting, default=0) for i in instances), default=0),
            "mean_queue_ms": mean_queue, "share_of_ttft": share, "series": series,
            "bottleneck": share >= QUEUE_SHARE_OF_TTFT and mean_queue > 1.0}


def _value_at(starts: list, durations: list, values: list, t: float):
    j = bisect_right(starts, t) - 1
    return values[j] if j >= 0 and t < starts[j] + durations[j] else 0


def _step_time(result, cost_model) -> dict:
    totals = {}
    for inst in result.instances:
        for key, value in breakdown_totals(inst.step_stats, cost_model).items():
            totals[key] = totals.get(key, 0.0) + value
    busy = sum(totals.values())
    shares = {f"{k}_share": (v / busy if busy else 0.0) for k, v in totals.items()}
    num_steps = sum(sum(inst.step_stats.column("num_steps")) for inst in result.instances)
    return {**shares, "num_steps": num_steps, "mean_step_ms": busy / num_steps * 1000 if num_steps else 0.0,
            "bottleneck": shares.get("communication_share", 0.0) >= COMMUNICATION_SHARE}
