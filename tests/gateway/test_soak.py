"""A shortened soak (servelab/testing/soak.py): 1,000 requests through a real gateway process over the
stub engine at saturation, with clients leaving at random points, requests running past --request-timeout
and injected step faults. Afterwards nothing is lost, nothing is held, and the books agree."""
from __future__ import annotations

import asyncio

from servelab.testing.server import metric_values, wait_for_metrics
from servelab.testing.soak import check_request_log, rss_bytes, run_soak

NUM_REQUESTS = 1000
CONCURRENCY = 48
# Growth of the server's anonymous RSS after warm-up (the first 10%); benchmarks/soak/run.py has the same bound.
# Cumulative snapshots queued without bound while the event loop lagged would fail it (the allocator kept that
# peak: 17-44 MiB here on a quiet machine); the in-process engine's outputs wait as at most one coalesced delta
# per request instead (core_client.OutputOutbox). A Python-level leak of ~20 KiB a request fails it too
# (keeping every step plan was ~100 KiB).
RSS_GROWTH_BOUND = 16 * 1024 * 1024
SOAK_FLAGS = ("--stub-num-blocks", "1024", "--stub-max-num-seqs", "32", "--stub-fail-word", "hello",
              "--request-timeout", "2", "--stub-step-delay", "0.002")  # 1,900 steps take >= 3.8 s: past the timeout


def idle(values: dict) -> bool:
    return (values["servelab:num_requests_running"] == values["servelab:num_requests_waiting"] == 0
            and values["servelab:kv_cache_usage_perc"] == 0)


def test_soak_1000_requests_loses_nothing_and_leaks_nothing(start_stub_server):
    server = start_stub_server(*SOAK_FLAGS)
    rss = {}

    def sample(done: int) -> None:
        if done == NUM_REQUESTS // 10:
            rss["warm"] = rss_bytes(server.proc.pid, "RssAnon")

    report = asyncio.run(run_soak(server.url, NUM_REQUESTS, CONCURRENCY, seed=0, on_progress=sample))
    rss["end"] = rss_bytes(server.proc.pid, "RssAnon")
    assert not report.lost, "\n".join(report.lost[:10])
    assert sum(report.outcomes.values()) == NUM_REQUESTS
    assert report.outcomes["200"] > NUM_REQUESTS // 2, report.outcomes
    expected = ("left:", "500:engine_step_failed", "504:request_timeout", "503:slow_reader")
    assert all(k == "200" or k.startswith(expected) for k in report.outcomes), report.outcomes
    assert report.planned["fault"] >= 1 and report.outcomes["500:engine_step_failed"] >= 1, report
    assert report.outcomes["504:request_timeout"] >= 1, report.outcomes
    for kind in ("before_first_token", "mid_stream", "during_prefill"):
        assert report.outcomes[f"left:{kind}"] >= 10, report.outcomes

    values = wait_for_metrics(server.url, idle)
    assert values["servelab:kv_cache_num_free_blocks"] == values["servelab:kv_cache_num_blocks"]
    books = check_request_log(server.request_log_lines(), report)
    assert books["num_logged_twice"] == books["num_not_logged"] == books["num_status_differs"] == 0, books
    assert rss["end"] - rss["warm"] < RSS_GROWTH_BOUND, rss
    assert metric_values(server.url)["servelab:num_requests_running"] == 0
