"""`servelab lab` command line: JSON keys, determinism, one-line errors with exit code 2."""
import argparse
import json

import pytest

from servelab.lab.cli import add_lab_parser, duration_ms, main

SMALL = ["--model", "llama-3.1-8b", "--gpu", "h100", "--dataset", "sharegpt-like", "--num-prompts", "60",
         "--request-rate", "6", "--ttft-target", "500ms", "--seed", "3"]


def run(capsys, *argv):
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_json_has_meters_and_load_generator_metric_keys(capsys):
    code, out, _ = run(capsys, "simulate", *SMALL, "--json")
    assert code == 0
    payload = json.loads(out)
    metrics = payload["metrics"]
    for key in ("request_throughput", "output_throughput"):
        assert metrics[key] > 0
    for stat in ("mean", "median", "p99"):
        for name in ("ttft", "tpot", "e2el"):
            assert f"{stat}_{name}_ms" in metrics
    for meter in ("kv_cache", "weights", "decode_throughput", "batch_slots", "ttft", "tpot", "goodput",
                  "preemptions", "queue"):
        assert isinstance(payload["meters"][meter]["bottleneck"], bool)
    assert payload["meters"]["ttft"]["target_ms"] == 500


def test_same_seed_byte_identical_output(capsys):
    first = run(capsys, "simulate", *SMALL, "--json")[1]
    assert first == run(capsys, "simulate", *SMALL, "--json")[1]
    other = run(capsys, "simulate", *SMALL[:-1], "4", "--json")[1]
    assert other != first


def test_table_output_and_disaggregated_shape(capsys):
    code, out, _ = run(capsys, "simulate", *SMALL, "--num-gpus", "3", "--disaggregate", "1:2")
    assert code == 0
    assert "1 prefill + 2 decode instances" in out and "KV transfer (P->D)" in out and "TTFT" in out


def test_not_fitting_deployment_exit_1_with_numbers(capsys):
    code, out, _ = run(capsys, "simulate", *SMALL, "--model", "llama-3.1-70b", "--gpu", "l4", "--json")
    payload = json.loads(out)
    assert code == 1 and payload["fits"] is False and "GiB" in payload["reason"]
    assert payload["meters"]["weights"]["bytes_per_gpu"] > 100e9


@pytest.mark.parametrize("argv, needle", [
    (["simulate", "--tp", "3", "--num-gpus", "4"], "not a multiple of --tp"),
    (["simulate", "--gpu", "h900"], "unknown GPU 'h900'"),
    (["simulate", "--request-rate", "fast"], "--request-rate"),
    (["simulate", "--ttft-target", "soon"], "500ms"),
    (["simulate", "--disaggregate", "2"], "P:D"),
    (["simulate", "--schedule", "eager"], "--schedule"),
    (["simulate", "--range-ratio", "1.5"], "--range-ratio must be in [0, 1)"),
    (["advise", "--num-prompts", "10"], "--ttft-target"),
    (["sweep", "--vary", "colour", "--values", "1"], "--vary"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, argv, needle):
    try:
        code = main(argv)
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and needle in err and err.count("\n") == 1 and "Traceback" not in err


def test_durations_accept_ms_and_s():
    assert duration_ms("500ms") == 500 and duration_ms("0.5s") == 500 and duration_ms("250") == 250
    with pytest.raises(argparse.ArgumentTypeError):
        duration_ms("-1s")


def test_sweep_writes_png(capsys, tmp_path):
    png = tmp_path / "rate.png"
    code, out, _ = run(capsys, "sweep", *SMALL, "--vary", "request-rate", "--values", "2,20",
                       "--meter", "kv_cache.peak_usage", "--output", str(png), "--json")
    points = json.loads(out)["points"]
    assert code == 0 and png.read_bytes()[:4] == b"\x89PNG"
    assert points[0]["kv_cache.peak_usage"] <= points[1]["kv_cache.peak_usage"]


def test_add_lab_parser_plugs_into_a_top_level_cli(capsys):
    parser = argparse.ArgumentParser(prog="servelab")
    add_lab_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["lab", "simulate", *SMALL, "--json"])
    assert args.func(args) == 0 and "metrics" in json.loads(capsys.readouterr().out)
