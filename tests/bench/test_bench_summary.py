"""The load generator's metric arithmetic on timestamps the test sets exactly (no server), the text and
PNG reports, goodput parsing, the sweep's rate search and the stages' helpers."""
import math

import pytest

from servelab.bench.loadgen import RequestResult
from servelab.bench.report import format_summary, plot_serve, summary_rows, tokens_per_second
from servelab.bench.serve import parse_goodput, summarize
from servelab.bench.stages import comparison_row, parse_stages, ratios, stage_flags
from servelab.bench.sweep import parse_rates, search_highest_rate

T0 = 100.0  # perf_counter of the benchmark's start


def results() -> list[RequestResult]:
    a = RequestResult(prompt_len=10, output_len=4, start=T0, chunk_times=[T0 + 1.0, T0 + 1.5, T0 + 2.0, T0 + 3.0])
    b = RequestResult(prompt_len=20, output_len=1, start=T0 + 0.5, chunk_times=[T0 + 0.7])
    c = RequestResult(prompt_len=30, start=T0 + 0.6, error="HTTP 429: queue full")
    d = RequestResult(prompt_len=30, start=T0 + 0.8, error="HTTP 429: queue full")
    # two chunks carrying 6 tokens (a server that batches its stream): TPOT uses tokens, ITL chunks
    e = RequestResult(prompt_len=5, output_len=6, start=T0 + 1.0, chunk_times=[T0 + 1.2, T0 + 2.2])
    return [a, b, c, d, e]


def test_summary_has_vllms_keys_and_definitions():
    s = summarize(results(), start=T0, end=T0 + 4.0, peak_concurrency=3, slos_ms={"ttft": 500})
    assert (s["completed"], s["failed"], s["duration"]) == (3, 2, 4.0)
    assert (s["total_input_tokens"], s["total_output_tokens"]) == (35, 11)
    assert s["request_throughput"] == 3 / 4 and s["output_throughput"] == 11 / 4
    assert s["total_token_throughput"] == 46 / 4
    # TTFT: a 1.0 s, b 0.2 s, e 0.2 s
    assert s["mean_ttft_ms"] == pytest.approx(1400 / 3) and s["median_ttft_ms"] == pytest.approx(200)
    # TPOT = (E2E - TTFT) / (output - 1): a (3 - 1) / 3, e (1.2 - 0.2) / 5; b has one token and none
    assert s["mean_tpot_ms"] == pytest.approx((2000 / 3 + 200) / 2)
    # ITL: gaps between content chunks: a 0.5, 0.5, 1.0; e 1.0
    assert s["mean_itl_ms"] == pytest.approx(750) and s["median_itl_ms"] == pytest.approx(750)
    assert s["mean_e2el_ms"] == pytest.approx((3000 + 200 + 1200) / 3)
    assert s["p99_e2el_ms"] == pytest.approx(3000 - 0.02 * 1800)  # numpy's linear interpolation
    # goodput: TTFT <= 500 ms holds for b and e; failed requests count against the share
    assert s["request_goodput"] == s["goodput"] == 2 / 4
    assert s["goodput_share"] == 2 / 5 and s["slo_attainment"] == 2 / 3
    assert s["max_concurrent_requests"] == 3
    assert s["error_counts"] == {"HTTP 429: queue full": 2}
    assert s["errors"] == ["", "", "HTTP 429: queue full", "HTTP 429: queue full", ""]
    assert s["output_lens"] == [4, 1, 0, 0, 6] and s["input_lens"] == [10, 20, 30, 30, 5]
    assert s["ttfts"] == pytest.approx([1.0, 0.2, 0.0, 0.0, 0.2]) and s["e2els"] == pytest.approx([3, 0.2, 0, 0, 1.2])
    assert s["itls"] == [pytest.approx([0.5, 0.5, 1.0]), [], [], [], pytest.approx([1.0])]
    assert s["start_times"] == pytest.approx([0, 0.5, 0.6, 0.8, 1.0])
    # tokens per 1 s bucket: b at 0.7; a at 1.0, 1.5, 2.0, 3.0; e's 6 tokens split over 1.2 and 2.2
    t, rate = tokens_per_second(s)
    assert t.tolist() == [0, 1, 2, 3] and rate.tolist() == pytest.approx([1, 5, 4, 1])
    assert s["max_output_tokens_per_s"] == pytest.approx(5)


def test_summary_without_slos_or_successes():
    s = summarize(results()[2:4], start=T0, end=T0 + 1.0, peak_concurrency=2)
    assert s["completed"] == 0 and s["failed"] == 2 and "request_goodput" not in s
    assert s["mean_ttft_ms"] == 0.0 and s["max_output_tokens_per_s"] == 0.0


def test_report_text_and_plots(tmp_path):
    s = {**summarize(results(), start=T0, end=T0 + 4.0, peak_concurrency=3, slos_ms={"ttft": 500}),
         "model_id": "m", "request_rate": 2.0, "max_concurrency": None}
    text = format_summary(s)
    for line in ("Successful requests:", "Failed requests:", "Request goodput (req/s):", "Mean TTFT (ms):",
                 "P99 TPOT (ms):", "Median ITL (ms):", "P90 E2EL (ms):", "error x2: HTTP 429: queue full"):
        assert line in text
    assert {"metric": "Successful requests", "value": "3"} in summary_rows(s)
    paths = plot_serve(s, tmp_path)
    assert [p.name for p in paths] == ["ttft_cdf.png", "tpot_cdf.png", "tokens_per_s.png"]
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in paths)


def test_goodput_and_rate_parsing():
    assert parse_goodput(["ttft:500", "tpot:50.5", "e2el:10000"]) == {"ttft": 500, "tpot": 50.5, "e2el": 10000}
    assert parse_goodput(None) == {}
    for bad in (["ttft"], ["itl:5"], ["ttft:-1"], ["ttft:abc"]):
        with pytest.raises(ValueError, match="--goodput"):
            parse_goodput(bad)
    assert parse_rates("1, 2.5,inf") == [1.0, 2.5, math.inf]
    for bad in ("", "a,b", "0,1"):
        with pytest.raises(ValueError, match="--request-rates"):
            parse_rates(bad)


def test_search_doubles_then_bisects():
    capacity = 11.0
    tried = []

    def share_at(rate):
        tried.append(rate)
        return 1.0 if rate <= capacity else 0.5

    best = search_highest_rate(share_at, 0.9, 1.0, 64.0, steps=3)
    assert tried == [1, 2, 4, 8, 16, 12, 10, 11] and best == 11
    assert search_highest_rate(lambda r: 1.0, 0.9, 1.0, 5.0, steps=3) == 5.0
    assert search_highest_rate(lambda r: 0.0, 0.9, 1.0, 5.0, steps=3) is None


def test_stage_helpers():
    assert parse_stages("serial, continuous") == ["serial", "continuous"]
    with pytest.raises(ValueError, match="--stages"):
        parse_stages("serial,paged")
    flags = stage_flags("static", 8, 500, "--dtype float32 --num-threads 1")
    assert flags[:4] == ["--schedule", "static", "--max-num-seqs", "8"] and flags[-4:] == [
        "--dtype", "float32", "--num-threads", "1"]
    assert "--max-num-seqs" not in stage_flags("serial", 8, 10, "")
    assert stage_flags("tp", 8, 10, "")[:6] == ["--schedule", "continuous", "--tensor-parallel-size", "3",
                                                 "--max-num-seqs", "8"]
    assert parse_stages("continuous,tp") == ["continuous", "tp"]
    assert flags[flags.index("--request-timeout") + 1] == "0"
    assert flags[flags.index("--max-num-queued-requests") + 1] == "500"
    runs = [{"schedule": "serial", "output_throughput": 10.0, "p99_ttft_ms": 900.0},
            {"schedule": "static", "output_throughput": 20.0, "p99_ttft_ms": 400.0},
            {"schedule": "continuous", "output_throughput": 40.0, "p99_ttft_ms": 100.0}]
    assert ratios(runs) == {"continuous_vs_serial_output_throughput": 4.0,
                            "continuous_vs_static_output_throughput": 2.0, "continuous_vs_static_p99_ttft": 0.25}
    hf = {"stage": "hf", "completed": 3, "failed": 0, "duration": 2.0, "request_throughput": 1.5,
          "output_throughput": 7.0}
    assert comparison_row(hf)["TTFT p99 ms"] == "-" and comparison_row(hf)["output tok/s"] == 7.0


def test_stage_5_is_continuous_batching_disaggregated_one_to_one():
    assert parse_stages("continuous,disaggregated") == ["continuous", "disaggregated"]
    flags = stage_flags("disaggregated", 8, 10, "--dtype float32")
    assert flags[:6] == ["--schedule", "continuous", "--disaggregate", "1:1", "--max-num-seqs", "8"]
    runs = [{"schedule": "continuous", "output_throughput": 40.0, "p99_ttft_ms": 100.0},
            {"schedule": "disaggregated", "output_throughput": 30.0, "p99_ttft_ms": 150.0}]
    assert ratios(runs) == {"disaggregated_vs_continuous_output_throughput": 0.75}
