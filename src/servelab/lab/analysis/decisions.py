"""Why each design decision is or is not taken for a workload, from simulated comparisons."""
from __future__ import annotations

from dataclasses import replace

from servelab.specs import GIB
from servelab.lab.sim.deployment import plan_memory
from servelab.lab.analysis.autoscaling import AutoscaleOutcome
from servelab.lab.analysis.evaluate import Evaluation, Targets, evaluate
from servelab.workload import SampledRequest


def _ttft(e: Evaluation) -> str:
    return f"p99 TTFT {e.metrics['p99_ttft_ms']:,.0f} ms"


def _line(decision: str, taken: bool, why: str) -> dict:
    return {"decision": decision, "taken": taken, "why": why}


def explain_decisions(rec: Evaluation, workload: list[SampledRequest], targets: Targets,
                      candidates: list[Evaluation]) -> list[dict]:
    d = rec.deployment
    colocated = replace(d, num_prefill_instances=0, num_decode_instances=0)
    static = evaluate(replace(colocated, schedule="static"), workload, targets)
    same_count = [e for e in candidates if e.fits and e.deployment.num_gpus == d.num_gpus]
    return [
        _kv_cache(rec, static), _continuous(rec, static), _tensor_parallel(rec, same_count, candidates, workload),
        _disaggregation(rec, same_count), _autoscaling(rec), _streaming(rec),
    ]


def _kv_cache(rec: Evaluation, static: Evaluation) -> dict:
    kv = rec.meters["kv_cache"]
    if not static.fits:
        return _line("KV-cache management", True, f"paged blocks on demand (peak {kv['peak_usage']:.0%} of the pool); "
                     "reserving prompt + max_tokens per request does not even fit here")
    waste = static.meters["kv_cache"].get("reserved_unused_share", 0.0)
    return _line("KV-cache management", True,
                 f"paged blocks on demand: peak use {kv['peak_usage']:.0%} of the pool, vs contiguous reservation "
                 f"of prompt + max_tokens that leaves {waste:.0%} of it reserved but unused")


def _continuous(rec: Evaluation, static: Evaluation) -> dict:
    if not static.fits:
        return _line("Continuous batching", True, "static batches cannot even reserve their KV here")
    s, c = static.metrics, rec.metrics
    return _line("Continuous batching", True,
                 f"admitting and retiring every step gives {_ttft(rec)} and {c['output_throughput']:,.0f} tok/s; "
                 f"static batches of {rec.deployment.max_num_seqs} give {_ttft(static)} and "
                 f"{s['output_throughput']:,.0f} tok/s")


def _tensor_parallel(rec: Evaluation, same_count: list[Evaluation], candidates: list[Evaluation],
                     workload: list[SampledRequest]) -> dict:
    d = rec.deployment
    one_gpu = replace(d, num_gpus=1, tensor_parallel_size=1, num_prefill_instances=0, num_decode_instances=0)
    memory = plan_memory(one_gpu, max(w.prompt_len + w.output_len for w in workload))
    tp1 = [e for e in same_count if e.deployment.tensor_parallel_size == 1]
    if d.tensor_parallel_size > 1:
        if not memory.fits:
            why = (f"TP {d.tensor_parallel_size}: {memory.weight_bytes / GIB:.0f} GiB of weights do not leave room "
                   f"for KV on one {d.device.id} ({memory.memory_bytes / GIB:.0f} GiB)")
        else:
            why = f"TP {d.tensor_parallel_size} cuts the step time (p99 TPOT {rec.metrics['p99_tpot_ms']:.1f} ms)"
        if tp1:
            best = min(tp1, key=lambda e: e.metrics["p99_ttft_ms"])
            why += f"; {best.deployment.num_instances} single-GPU replicas give {_ttft(best)}"
        smaller = [e for e in candidates if e.fits and e.deployment.num_gpus <= d.num_gpus
                   and e.deployment.tensor_parallel_size < d.tensor_parallel_size]
        if smaller:
            best = min(smaller, key=lambda e: e.metrics["p99_ttft_ms"])
            why += (f"; the best smaller-TP shape ({best.deployment.num_gpus} GPUs, TP "
                    f"{best.deployment.tensor_parallel_size}) gives {_ttft(best)}, p99 TPOT "
                    f"{best.metrics['p99_tpot_ms']:.1f} ms{'' if best.meets_targets else ', missing the targets'}")
        return _line("Tensor-parallel sharding", True, why)
    share = rec.meters["weights"]["share_of_memory"]
    return _line("Tensor-parallel sharding", False,
                 f"the weights take {share:.0%} of one GPU, so whole-model replicas avoid all-reduces per layer")


def _disaggregation(rec: Evaluation, same_count: list[Evaluation]) -> dict:
    d = rec.deployment
    split = [e for e in same_count if e.deployment.disaggregated]
    together = [e for e in same_count if not e.deployment.disaggregated]
    if d.disaggregated:
        why = (f"{d.num_prefill_instances}:{d.num_decode_instances} prefill:decode instances keep long prefills "
               f"from stalling decode steps ({_ttft(rec)}, p99 TPOT {rec.metrics['p99_tpot_ms']:.1f} ms)")
        if together:
            best = min(together, key=lambda e: e.metrics["p99_ttft_ms"])
            why += f"; colocated gives {_ttft(best)}, p99 TPOT {best.metrics['p99_tpot_ms']:.1f} ms"
        return _line("Prefill/decode split", True, why)
    if not split:
        return _line("Prefill/decode split", False, f"{d.num_instances} instance(s) cannot be split into prefill and "
                     "decode pools; chunked prefill mixes both in each step")
    best = min(split, key=lambda e: e.metrics["p99_ttft_ms"])
    return _line("Prefill/decode split", False,
                 f"the best split at {d.num_gpus} GPUs ({best.deployment.num_prefill_instances}:"
                 f"{best.deployment.num_decode_instances}) gives {_ttft(best)} vs {_ttft(rec)} colocated")


def _autoscaling(rec: Evaluation) -> dict:
    d, dec = rec.deployment, rec.meters["decode_throughput"]
    if d.num_instances > 1:
        return _line("GPU autoscaling", True,
                     f"{d.num_instances} instances run at {dec['utilization']:.0%} of decode capacity; add or remove "
                     "instances as the request rate moves, watching queue length and KV-cache use")
    return _line("GPU autoscaling", False,
                 f"one instance carries the load at {dec['utilization']:.0%} of its decode capacity; there is "
                 "nothing to scale down to")


# SLO attainment an autoscaler may give up against the fixed deployment of its maximum and still be worth it
AUTOSCALE_ATTAINMENT_SLACK = 0.01


def simulated_autoscaling(outcome: AutoscaleOutcome) -> dict:
    """The GPU autoscaling decision from a simulated run over the workload's rate schedule: the replicas the
    autoscaler chose, its GPU-hours against a fixed deployment of its maximum, and both SLO attainments."""
    s, f = outcome.summaries()
    low, high = outcome.replica_range()
    saved = 1 - s["gpu_hours"] / f["gpu_hours"] if f["gpu_hours"] else 0.0
    clauses = [f"simulated, the autoscaler kept {low} to {high} replicas serving",
               f"{s['gpu_hours']:,.1f} GPU-hours against {f['gpu_hours']:,.1f} for a fixed {f['num_replicas_peak']} "
               "replicas",
               f"it saves {saved:.1%} of the GPU-hours" if saved > 0 else "it saves no GPU-hours"]
    keeps_slos = True
    if s["slo_attainment"] is not None:
        clauses.append(f"{s['slo_attainment']:.1%} of requests meet the targets (fixed: {f['slo_attainment']:.1%})")
        keeps_slos = s["slo_attainment"] >= f["slo_attainment"] - AUTOSCALE_ATTAINMENT_SLACK
        if not keeps_slos:
            clauses.append("the fixed deployment meets the targets for more requests")
    return _line("GPU autoscaling", saved > 0 and keeps_slos, "; ".join(clauses))


def _streaming(rec: Evaluation) -> dict:
    m = rec.metrics
    ratio = m["median_e2el_ms"] / max(m["median_ttft_ms"], 1e-9)
    return _line("Token streaming", True,
                 f"the first token arrives after p50 {m['median_ttft_ms']:,.0f} ms, the whole answer after "
                 f"{m['median_e2el_ms']:,.0f} ms: streaming shows text {ratio:,.0f}x sooner")
