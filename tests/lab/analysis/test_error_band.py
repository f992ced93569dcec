"""Error bands: each simulated figure carries the held-out error of the nearest regime's published points."""
import contextlib
import io
import json

import pytest

from servelab.entrypoints.cli import main
from servelab.lab.analysis.error_band import Regime, band, metric_kind


def point(metric, error, precision="bf16", tp=1, load="low", engine="vllm"):
    return {"metric": metric, "held_out_error": error, "precision": precision, "tp": tp, "load": load, "engine": engine}


POINTS = ([point("median_ttft_ms", e) for e in (0.1, -0.2, 0.3)]  # bf16, TP1, low load, vllm
          + [point("median_ttft_ms", 0.4, engine="sglang") for _ in range(2)]
          + [point("median_ttft_ms", -0.5, tp=4, load="high") for _ in range(3)]
          + [point("median_tpot_ms", 0.05, precision="fp8") for _ in range(3)]
          + [point("mean_itl_ms", 0.3, precision="fp8")])


def test_the_band_is_the_mean_held_out_error_of_the_fullest_matching_regime():
    b = band(POINTS, "ttft", Regime("bf16", "TP1", "low", "vllm"))
    assert b.relative == pytest.approx(0.2) and b.num_points == 3
    assert b.text == "±20%: BF16, TP1, low load, vllm; 3 points"


def test_the_band_relaxes_engine_then_load_then_tp_but_never_precision():
    # sglang has only two TTFT points: drop the engine, keep bf16, TP1, low load (3 vllm + 2 sglang)
    b = band(POINTS, "ttft", Regime("bf16", "TP1", "low", "sglang"))
    assert b.num_points == 5 and b.regime == "BF16, TP1, low load"
    b = band(POINTS, "ttft", Regime("bf16", "TP>1", "high", "lmdeploy"))
    assert b.num_points == 3 and b.relative == pytest.approx(0.5) and b.regime == "BF16, TP>1, high load"
    # TPOT and ITL are one kind (decode); fp8 has four such points
    assert band(POINTS, "decode", Regime("fp8", "TP>1", "high", "vllm")).num_points == 4


def test_a_regime_without_points_says_so_instead_of_guessing():
    b = band(POINTS, "ttft", Regime("fp4", "TP1", "low", "vllm"))
    assert b.relative is None and b.text == "no reference points for TTFT at FP4: no error band"
    assert band(POINTS, "e2el", Regime("bf16", "TP1", "low", "vllm")).relative is None


def test_metric_kinds():
    assert [metric_kind(m) for m in ("p99_ttft_ms", "median_itl_ms", "mean_e2el_ms", "request_throughput",
                                     "completed")] == ["ttft", "decode", "e2el", "throughput", None]


def run(argv):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        main(["lab", "simulate", "--num-prompts", "30", "--input-len", "200", "--output-len", "20", *argv])
    return out.getvalue()


def test_simulate_names_its_engine_and_bands_every_figure_in_json_and_text():
    data = json.loads(run(["--request-rate", "2", "--engine", "vllm-v0", "--json"]))
    assert data["engine"] == "vllm-v0"
    bands = data["error_bands"]
    assert bands["regime"] == {"precision": "bf16", "tp": "TP1", "load": "low", "engine": "vllm-v0"}
    assert {"median_ttft_ms", "p99_tpot_ms", "output_throughput"} <= set(bands["metrics"])
    text = run(["--request-rate", "2", "--engine", "vllm-v0"])
    assert "engine vllm-v0; error bands" in text
    ttft = bands["metrics"]["median_ttft_ms"]
    assert f"TTFT p50 {data['metrics']['median_ttft_ms']:,.1f} ms ({ttft['text']})" in text
    # no published point ran fp4: the figures say so
    fp4 = json.loads(run(["--gpu", "b200", "--dtype", "fp4", "--json"]))
    assert fp4["error_bands"]["metrics"]["median_ttft_ms"]["band"] is None
