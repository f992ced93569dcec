"""`lab validate` compares the simulation with the median of repeated real runs and reports their spread."""
import pytest

from servelab.lab.calibrate.validate import CHECKED, median_compare, table_rows


def _run(tok_s, ttft, tpot):
    return {"output_throughput": tok_s, "median_ttft_ms": ttft, "median_tpot_ms": tpot, "p99_ttft_ms": 2 * ttft,
            "median_e2el_ms": 10 * tpot, "request_throughput": tok_s / 64}


def test_medians_errors_and_spread():
    reals = [_run(50, 300, 60), _run(40, 250, 80), _run(52, 400, 50)]
    sims = [_run(48, 280, 55), _run(51, 260, 70), _run(45, 290, 65)]
    c = median_compare("3 continuous + paged", reals, sims)
    assert c["real"]["output_throughput"] == 50 and c["simulated"]["output_throughput"] == 48
    assert c["error"]["median_ttft_ms"] == pytest.approx(280 / 300 - 1)
    assert c["spread"]["median_tpot_ms"] == pytest.approx(80 / 50 - 1)
    assert len(c["runs"]) == len(c["simulated_runs"]) == 3
    rows = table_rows([c])
    checked = [r for r in rows if r["metric"].endswith("*")]
    assert len(checked) == len(CHECKED)
    tpot = next(r for r in rows if r["metric"].startswith("TPOT"))
    assert tpot["real spread"] == "60%" and tpot["error"] == f"{65 / 60 - 1:+.1%}"


def test_a_metric_missing_from_every_run_is_not_compared():
    reals = [{**_run(50, 300, 60), "median_tpot_ms": None}] * 2
    c = median_compare("1 serial", reals, [_run(50, 300, 60)] * 2)
    assert c["real"]["median_tpot_ms"] is None and c["error"]["median_tpot_ms"] is None
    assert c["spread"]["median_tpot_ms"] is None
