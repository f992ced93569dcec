"""Every simulated figure with its error band: how far the lab's held-out predictions of published points
of the nearest regime were off.

The band of a figure is the mean |error| of the calibration's leave-one-source-out predictions (each point
predicted by a fit that never saw its source) over the reference points of the same kind of figure (TTFT,
decode TPOT/ITL, end-to-end latency, throughput) in the nearest regime: the same precision always, then as
many of TP, load level and engine as still leave MIN_POINTS points, relaxed in that order from the last. A
regime without MIN_POINTS such points, even at its precision alone, says so instead of guessing.
"""
from __future__ import annotations

from dataclasses import dataclass

from servelab.lab.catalog.calibration import CalibrationProfile
from servelab.specs import precision

MIN_POINTS = 3
ATTRIBUTES = ("precision", "tp", "load", "engine")  # most important first: the last is relaxed first
# a utilization of the decode capacity at or above this, or a queue, is a high load
HIGH_LOAD_UTILIZATION = 0.5
KINDS = {"ttft": "TTFT", "decode": "TPOT", "e2el": "E2E latency", "throughput": "throughput"}
PRECISION_LABELS = {"bf16": "BF16", "fp8": "FP8", "fp4": "FP4", "gptq-int4": "GPTQ int4"}


def metric_kind(metric: str) -> str | None:
    if "ttft" in metric:
        return "ttft"
    if "tpot" in metric or "itl" in metric:
        return "decode"
    if "e2el" in metric:
        return "e2el"
    if metric.endswith("throughput"):
        return "throughput"
    return None


@dataclass(frozen=True)
class Regime:
    precision: str
    tp: str  # "TP1" or "TP>1"
    load: str  # "low" or "high"
    engine: str

    def label(self, attributes: tuple[str, ...]) -> str:
        words = {"precision": PRECISION_LABELS.get(self.precision, self.precision), "tp": self.tp,
                 "load": f"{self.load} load", "engine": self.engine}
        return ", ".join(words[a] for a in attributes)


def tp_class(tp: int) -> str:
    return "TP1" if tp == 1 else "TP>1"


def point_regime(point: dict) -> Regime:
    return Regime(point.get("precision", ""), tp_class(point.get("tp", 0)), point.get("load", ""), point["engine"])


def simulation_regime(deployment: dict, meters: dict, engine: str) -> Regime:
    """A simulation's regime from its --json deployment and meters."""
    decode, queue = meters.get("decode_throughput", {}), meters.get("queue", {})
    high = decode.get("utilization", 0.0) >= HIGH_LOAD_UTILIZATION or queue.get("mean_waiting", 0.0) >= 1.0
    return Regime(precision(deployment["dtype"], deployment.get("quantization")), tp_class(deployment["tp"]),
                  "high" if high else "low", engine)


@dataclass(frozen=True)
class Band:
    kind: str
    relative: float | None  # mean |held-out error|; None: no points
    num_points: int
    regime: str  # the regime matched, in words
    text: str
    matched: dict  # the regime's attributes that matched (what the page words in its language)

    def to_json(self) -> dict:
        return {"band": self.relative, "num_points": self.num_points, "regime": self.regime, "text": self.text,
                "matched": self.matched}


def band(points: list[dict], kind: str, regime: Regime) -> Band:
    pool = [p for p in points if metric_kind(p["metric"]) == kind and p.get("held_out_error") is not None]
    for n in range(len(ATTRIBUTES), 0, -1):
        attributes = ATTRIBUTES[:n]
        matched = [p for p in pool if all(getattr(point_regime(p), a) == getattr(regime, a) for a in attributes)]
        if len(matched) >= MIN_POINTS:
            error = sum(abs(p["held_out_error"]) for p in matched) / len(matched)
            where = regime.label(attributes)
            return Band(kind, error, len(matched), where, f"±{error:.0%}: {where}; {len(matched)} points",
                        {a: getattr(regime, a) for a in attributes})
    where = regime.label(("precision",))
    return Band(kind, None, 0, where, f"no reference points for {KINDS[kind]} at {where}: no error band",
                {"precision": regime.precision})


def error_bands(profile: CalibrationProfile, deployment: dict, meters: dict, metrics: dict, engine: str) -> dict:
    """Each banded metric's band (`lab simulate --json`'s "error_bands"), from the profile's held-out points."""
    points = profile.fit.get("points", [])
    regime = simulation_regime(deployment, meters, engine)
    by_kind = {kind: band(points, kind, regime) for kind in KINDS}
    summary = profile.fit.get("summary", {})
    out = {"regime": regime.__dict__, "calibration": {
        "name": profile.name, "cross_validation": summary.get("cross_validation"),
        **{k: summary.get(k) for k in ("held_out_mean_abs_error", "fitted_mean_abs_error", "num_points", "num_sources")}},
        "metrics": {}}
    for name in metrics:
        kind = metric_kind(name)
        if kind is not None:
            out["metrics"][name] = by_kind[kind].to_json()
    return out
