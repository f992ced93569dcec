"""The cost frontier: cited prices and their overrides, Pareto sets, and `lab advise --pareto` end to end."""
import json

import pytest

from servelab.errors import FieldError
from servelab.lab.analysis.frontier import pareto
from servelab.lab.catalog import gpu_ids
from servelab.lab.catalog.prices import load_prices, parse_price_overrides
from servelab.lab.catalog.lookup import DATA_DIR
from servelab.lab.cli import main

FRONTIER = ["--model", "llama-3.1-8b", "--gpus", "h100,a100-80gb", "--num-prompts", "40", "--request-rate", "8",
            "--input-len", "512", "--output-len", "64", "--ttft-target", "300ms", "--frontier-max-gpus", "2",
            "--max-num-seqs-grid", "32,128"]


def test_every_shipped_price_is_cited_and_every_catalog_gpu_priced_or_said_missing():
    for name in ("prices.json", "prices-hyperscalers.json"):
        raw = json.loads((DATA_DIR / name).read_text())
        for gpu, entry in raw.items():
            if gpu.startswith("_"):
                continue
            assert gpu in gpu_ids()
            assert entry["usd_per_gpu_hour"] > 0 and entry["date"] and entry["source"] and entry["provider"]
    raw = json.loads((DATA_DIR / "prices.json").read_text())
    for gpu in gpu_ids():
        assert gpu in raw or gpu in raw["_missing"]


def test_overrides_replace_one_price_and_reject_bad_input(tmp_path):
    prices = load_prices(overrides=parse_price_overrides(["h100=1.25"]))
    assert prices["h100"].usd_per_gpu_hour == 1.25 and prices["h100"].source == "override"
    assert prices["h200"].usd_per_gpu_hour == load_prices()["h200"].usd_per_gpu_hour
    with pytest.raises(FieldError):
        parse_price_overrides(["h100"])
    with pytest.raises(FieldError):
        parse_price_overrides(["h100=-3"])
    with pytest.raises(FieldError):
        load_prices(overrides={"tpu": 1.0})
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"h100": {"usd_per_gpu_hour": 2.0, "provider": "mine", "date": "2026-01-01"}}))
    assert list(load_prices(path)) == ["h100"]
    path.write_text(json.dumps({"h100": {"usd_per_gpu_hour": "x"}}))
    with pytest.raises(FieldError):
        load_prices(path)


def test_pareto_keeps_exactly_the_undominated_points():
    points = [(1, 5), (2, 4), (2, 6), (3, 3), (3, 6), (4, 1), (2, 6)]  # (cost, attainment): low cost, high attainment

    def better(a, b):
        return a[0] <= b[0] and a[1] >= b[1] and a != b

    assert sorted(pareto(points, better, key=lambda p: p)) == [(1, 5), (2, 6)]


def test_advise_pareto_json_is_priced_and_consistent(capsys):
    code = main(["advise", "--pareto", *FRONTIER, "--price", "h100=2.0", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    points = out["points"]
    assert {p["gpu"] for p in points} == {"h100", "a100-80gb"}
    for p in points:
        assert p["usd_per_hour"] == pytest.approx(p["num_gpus"] * p["usd_per_gpu_hour"])
        assert p["usd_per_million_tokens"] == pytest.approx(p["usd_per_hour"] / (p["output_throughput"] * 3600) * 1e6)
        assert set(p["fidelity_band"]) == {"p99_ttft_ms", "p99_tpot_ms", "output_throughput"}  # error_band.py's
    assert all(p["usd_per_gpu_hour"] == 2.0 for p in points if p["gpu"] == "h100")
    cheapest = out["cheapest"]
    assert cheapest["meets_targets"]
    assert cheapest["usd_per_million_tokens"] == min(p["usd_per_million_tokens"] for p in points if p["meets_targets"])
    cost = out["cost_frontier"]
    for p in points:  # nothing beats a frontier point on both axes
        for f in cost:
            assert not (p["usd_per_million_tokens"] < f["usd_per_million_tokens"]
                        and p["slo_attainment"] > f["slo_attainment"])
    assert [f["usd_per_million_tokens"] for f in cost] == sorted(f["usd_per_million_tokens"] for f in cost)


def test_frontier_table_plot_and_errors(capsys, tmp_path):
    code = main(["sweep", "--pareto", *FRONTIER, "--plot", str(tmp_path / "f.png")])
    out = capsys.readouterr().out
    assert code == 0
    assert "cheapest meeting the targets:" in out and "cost frontier" in out and "every configuration" in out
    assert (tmp_path / "f.png").read_bytes()[:4] == b"\x89PNG"
    assert main(["advise", "--pareto", *FRONTIER, "--price", "h100=abc"]) == 2
    assert "--price" in capsys.readouterr().err
    assert main(["advise", "--pareto", *FRONTIER, "--gpus", "tpu-v9"]) == 2
    assert "--gpus" in capsys.readouterr().err
