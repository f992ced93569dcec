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


def test_a_refresh_profiles_again_with_the_settings_the_profile_was_measured_with(monkeypatch):
    """Between repeats `lab validate` re-runs `lab profile` in its own process; the command it runs parses, with
    servelab's own CLI parser, into the profiled engine: mode, batch limits, KV pool, --quick and --repeats."""
    import argparse
    import subprocess
    import sys
    from dataclasses import replace

    from servelab.entrypoints.cli import build_parser
    from servelab.lab.calibrate.validate import refresh_profile
    from servelab.lab.catalog import get_model

    from tests.lab.calibrate.test_profile import make_profile

    profile = make_profile()
    profile = replace(profile, quantization="int8", kv_cache_dtype="int8",
                      fit={**profile.fit, "quick": True, "repeats": 1})
    ran = []
    monkeypatch.setattr(subprocess, "run", lambda command, **kw: ran.append((command, kw)))
    refresh_profile(argparse.Namespace(model="/models/tiny"), profile, get_model("smollm2-135m"))
    (command, kw), = ran
    assert command[:3] == [sys.executable, "-m", "servelab.entrypoints.cli"] and kw["check"] is True
    args = build_parser().parse_args(command[3:])
    assert (args.quantization, args.kv_cache_dtype, args.dtype) == ("int8", "int8", "bfloat16")
    assert (args.max_num_seqs, args.max_num_batched_tokens, args.block_size) == (128, 1024, 16)
    assert args.num_kv_blocks == profile.num_kv_blocks(get_model("smollm2-135m"))
    assert args.model == "/models/tiny" and args.quick and args.repeats == 1
