"""The cost frontier: simulate GPU type x GPU count x TP x P:D split x max batch for one workload, price each
configuration from the GPU price catalog, and keep the cheapest configuration meeting the targets and the two
Pareto frontiers planners draw (AIConfigurator, Vidur-Search): tokens/s per GPU against a latency percentile,
and $ per million output tokens against SLO attainment."""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable

from servelab.lab.analysis.advisor import shapes
from servelab.lab.analysis.evaluate import Evaluation, Targets, evaluate
from servelab.lab.catalog.prices import GpuPrice
from servelab.lab.sim.deployment import Deployment, plan_memory
from servelab.workload import SampledRequest

DEFAULT_GPU_COUNTS = (1, 2, 4, 8, 16)
DEFAULT_MAX_NUM_SEQS = (64, 256)
LATENCY_METRICS = ("p99_ttft_ms", "p90_ttft_ms", "median_ttft_ms", "p99_tpot_ms", "p90_tpot_ms", "median_tpot_ms")


@dataclass(frozen=True)
class FrontierPoint:
    evaluation: Evaluation
    price: GpuPrice
    # the calibration's error bands (lab/analysis/error_band.py) of the point's TTFT, TPOT and throughput
    fidelity_band: dict | None = None

    @property
    def deployment(self) -> Deployment:
        return self.evaluation.deployment

    @property
    def usd_per_hour(self) -> float:
        return self.deployment.num_gpus * self.price.usd_per_gpu_hour

    @property
    def output_throughput(self) -> float:
        return self.evaluation.metrics["output_throughput"]

    @property
    def tokens_per_s_per_gpu(self) -> float:
        return self.output_throughput / self.deployment.num_gpus

    @property
    def usd_per_million_tokens(self) -> float:
        """$ per million output tokens: the deployment's hourly price over the output tokens it served an hour."""
        return self.usd_per_hour / (self.output_throughput * 3600) * 1e6

    @property
    def slo_attainment(self) -> float:
        return self.evaluation.metrics.get("slo_attainment", 1.0)

    def label(self) -> str:
        d = self.deployment
        shape = (f"{d.num_prefill_instances}P:{d.num_decode_instances}D" if d.disaggregated
                 else f"{d.num_instances}x")
        return f"{d.device.id} {shape} TP{d.tensor_parallel_size} seqs{d.max_num_seqs}"

    def to_json(self) -> dict:
        d, m = self.deployment, self.evaluation.metrics
        return {
            "label": self.label(), "gpu": d.device.id, "num_gpus": d.num_gpus, "tp": d.tensor_parallel_size,
            "num_replicas": 0 if d.disaggregated else d.num_instances,
            "disaggregate": f"{d.num_prefill_instances}:{d.num_decode_instances}" if d.disaggregated else None,
            "max_num_seqs": d.max_num_seqs, "usd_per_gpu_hour": self.price.usd_per_gpu_hour,
            "usd_per_hour": self.usd_per_hour, "usd_per_million_tokens": self.usd_per_million_tokens,
            "output_throughput": self.output_throughput, "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu,
            **{k: m[k] for k in LATENCY_METRICS},
            "slo_attainment": self.slo_attainment, "meets_targets": self.evaluation.meets_targets,
            "fidelity_band": self.fidelity_band,
        }


@dataclass
class Frontier:
    points: list[FrontierPoint]  # every configuration that fits
    latency_metric: str
    cheapest: FrontierPoint | None  # meeting the targets
    throughput_frontier: list[FrontierPoint]  # max tokens/s per GPU for each latency, by latency
    cost_frontier: list[FrontierPoint]  # min $/M tokens for each SLO attainment, by cost
    num_simulated: int = 0
    skipped: dict[str, str] = field(default_factory=dict)  # gpu -> why it is not searched

    def to_json(self) -> dict:
        return {
            "latency_metric": self.latency_metric,
            "cheapest": self.cheapest.to_json() if self.cheapest else None,
            "throughput_frontier": [p.to_json() for p in self.throughput_frontier],
            "cost_frontier": [p.to_json() for p in self.cost_frontier],
            "points": [p.to_json() for p in self.points],
            "num_simulated": self.num_simulated,
            "skipped": self.skipped,
        }


def pareto(points: list, better: Callable[[object, object], bool], key: Callable[[object], tuple]) -> list:
    """The points no other point dominates; better(a, b): a is at least as good on both axes and better on one.
    Of points equal on both axes (key), the first stands for them all."""
    firsts = list({key(p): p for p in reversed(points)}.values())
    return [p for p in firsts if not any(better(q, p) for q in firsts if q is not p)]


def _throughput_dominates(metric: str) -> Callable[[FrontierPoint, FrontierPoint], bool]:
    def better(a: FrontierPoint, b: FrontierPoint) -> bool:
        la, lb = a.evaluation.metrics[metric], b.evaluation.metrics[metric]
        ta, tb = a.tokens_per_s_per_gpu, b.tokens_per_s_per_gpu
        return la <= lb and ta >= tb and (la < lb or ta > tb)
    return better


def _cost_dominates(a: FrontierPoint, b: FrontierPoint) -> bool:
    ca, cb, sa, sb = a.usd_per_million_tokens, b.usd_per_million_tokens, a.slo_attainment, b.slo_attainment
    return ca <= cb and sa >= sb and (ca < cb or sa > sb)


BANDED = ("p99_ttft_ms", "p99_tpot_ms", "output_throughput")


def search(bases: dict[str, Deployment], prices: dict[str, GpuPrice], workload: list[SampledRequest],
           targets: Targets, gpu_counts: tuple[int, ...] = DEFAULT_GPU_COUNTS,
           max_num_seqs: tuple[int, ...] = DEFAULT_MAX_NUM_SEQS, latency_metric: str = "p99_ttft_ms",
           skipped: dict[str, str] | None = None,
           error_bands: Callable[[Evaluation], dict | None] = lambda e: None) -> Frontier:
    """bases: per GPU id, a deployment carrying that GPU's calibrated efficiency and the engine settings;
    error_bands: an evaluation's bands (`lab simulate --json`'s "error_bands"), of which each point keeps BANDED."""
    if latency_metric not in LATENCY_METRICS:
        raise ValueError(f"latency metric must be one of {', '.join(LATENCY_METRICS)}")
    max_request = max(w.prompt_len + w.output_len for w in workload)
    points, num_simulated = [], 0
    skipped = dict(skipped or {})
    for gpu, base in bases.items():
        if gpu not in prices:
            skipped[gpu] = "no cited price (give one with --price GPU=USD)"
            continue
        for num_gpus in gpu_counts:
            for shape in shapes(base, num_gpus):
                for seqs in max_num_seqs:
                    d = replace(shape, max_num_seqs=seqs)
                    if not plan_memory(d, max_request).fits:
                        continue
                    e = evaluate(d, workload, targets)
                    num_simulated += 1
                    if e.fits and e.metrics["output_throughput"] > 0:
                        bands = error_bands(e)
                        band = {k: v for k, v in bands["metrics"].items() if k in BANDED} if bands else None
                        points.append(FrontierPoint(e, prices[gpu], band))
    passing = [p for p in points if p.evaluation.meets_targets]
    cheapest = min(passing, key=lambda p: (p.usd_per_million_tokens, p.evaluation.metrics[latency_metric]),
                   default=None)
    throughput = sorted(pareto(points, _throughput_dominates(latency_metric),
                               lambda p: (p.evaluation.metrics[latency_metric], p.tokens_per_s_per_gpu)),
                        key=lambda p: p.evaluation.metrics[latency_metric])
    cost = sorted(pareto(points, _cost_dominates, lambda p: (p.usd_per_million_tokens, p.slo_attainment)),
                  key=lambda p: p.usd_per_million_tokens)
    return Frontier(points, latency_metric, cheapest, throughput, cost, num_simulated, skipped)
