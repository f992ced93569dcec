"""The advisor: the cheapest deployment (fewest GPUs) that meets the targets for a workload on a GPU
type, found by simulating shapes (TP degree x replicas x prefill/decode split), and one line per
design decision saying why it is or is not taken."""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from servelab.specs import DeviceSpec, ModelSpec
from servelab.lab.analysis.decisions import explain_decisions
from servelab.lab.sim.deployment import Deployment, plan_memory
from servelab.lab.analysis.evaluate import Evaluation, Targets, evaluate
from servelab.workload import SampledRequest

TP_DEGREES = (1, 2, 4, 8)
DEFAULT_MAX_GPUS = 64


@dataclass
class Advice:
    recommendation: Evaluation | None
    decisions: list[dict]
    candidates: list[Evaluation] = field(default_factory=list)
    max_gpus: int = DEFAULT_MAX_GPUS

    def with_decision(self, line: dict) -> "Advice":
        """This advice with the decision of line's name replaced by line (a decision simulated afterwards)."""
        decisions = [line if d["decision"] == line["decision"] else d for d in self.decisions]
        return replace(self, decisions=decisions)

    def to_json(self) -> dict:
        rec = self.recommendation
        return {
            "recommendation": rec.to_json() if rec else None,
            "decisions": self.decisions,
            "candidates": [_summary(e) for e in self.candidates],
            "max_gpus": self.max_gpus,
        }


def _summary(e: Evaluation) -> dict:
    out = {"deployment": e.deployment.describe(), "num_gpus": e.deployment.num_gpus, "fits": e.fits,
           "meets_targets": e.meets_targets}
    if e.fits:
        out.update({k: e.metrics[k] for k in ("p99_ttft_ms", "p99_tpot_ms", "output_throughput")})
    return out


def shapes(base: Deployment, num_gpus: int) -> list[Deployment]:
    """Every continuous-batching shape with num_gpus GPUs: replicas of TP groups, and P:D splits."""
    out = []
    for tp in TP_DEGREES:
        if num_gpus % tp:
            continue
        n = num_gpus // tp
        # a few prefill shares rather than every split: 1 instance, a quarter, a third, half
        prefill = sorted({p for p in (1, n // 4, n // 3, n // 2) if 1 <= p < n})
        splits = [(0, 0)] + [(p, n - p) for p in prefill]
        for p, d in splits:
            try:
                out.append(replace(base, num_gpus=num_gpus, tensor_parallel_size=tp, schedule="continuous",
                                   num_prefill_instances=p, num_decode_instances=d))
            except ValueError:
                continue  # TP degree the model or node cannot take
    return out


def _best(evaluations: list[Evaluation]) -> Evaluation | None:
    passing = [e for e in evaluations if e.meets_targets]
    if not passing:
        return None
    return min(passing, key=lambda e: (e.metrics["p99_ttft_ms"], -e.metrics["output_throughput"]))


def advise(model: ModelSpec, device: DeviceSpec, workload: list[SampledRequest], targets: Targets,
           base: Deployment | None = None, max_gpus: int = DEFAULT_MAX_GPUS) -> Advice:
    """Search GPU counts by doubling, then bisect between the last count that failed and the first
    that passed (more GPUs at equal load never hurt the best shape, so passing is monotone)."""
    base = base or Deployment(model, device, num_gpus=1)
    max_request = max(w.prompt_len + w.output_len for w in workload)
    candidates: list[Evaluation] = []
    tried: dict[int, Evaluation | None] = {}

    def best_at(num_gpus: int) -> Evaluation | None:
        if num_gpus not in tried:
            evaluations = [evaluate(d, workload, targets) for d in shapes(base, num_gpus)
                           if plan_memory(d, max_request).fits]
            candidates.extend(evaluations)
            tried[num_gpus] = _best(evaluations)
        return tried[num_gpus]

    low, high = 0, 1  # low: largest count known to fail
    while high <= max_gpus and best_at(high) is None:
        low, high = high, high * 2
    if high > max_gpus:
        if low < max_gpus and best_at(max_gpus) is not None:
            high = max_gpus
        else:
            return Advice(None, [], candidates, max_gpus)
    while high - low > 1:
        mid = (low + high) // 2
        if best_at(mid) is not None:
            high = mid
        else:
            low = mid
    rec = tried[high]
    return Advice(rec, explain_decisions(rec, workload, targets, candidates), candidates, max_gpus)
