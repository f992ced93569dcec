"""The load generator's client against a fake server that emits chunks when the test says: TTFT, ITL,
TPOT and E2E against the server's own send times, usage vs re-tokenized counts, errors, arrivals."""
import asyncio

import pytest
from fake_openai_server import MODEL, FakeOpenAIServer, Plan

from servelab.bench.datasets import BenchRequest
from servelab.bench.loadgen import NO_CONTENT_ERROR, ClientConfig, first_model_id, run_requests
from servelab.bench.serve import summarize

# The client reads a chunk within this long of the server sending it (a loaded 2-core machine).
SLACK_S = 0.15  # the fake server and the client share two busy cores


def requests(n: int, output_len: int = 5, gap_s: float = 0.0, text: bool = False) -> list[BenchRequest]:
    return [BenchRequest(f"prompt {i}" if text else [100 + i, 7], 2, output_len, i * gap_s) for i in range(n)]


def run(server, reqs, endpoint="/v1/completions", **kwargs):
    config = ClientConfig(base_url=server.url, endpoint=endpoint, model=MODEL, ignore_eos=True)
    return asyncio.run(run_requests(config, reqs, **kwargs))


def sent_times(server, result_prompt):
    for body, times in zip(server.bodies, server.emit_times):
        if body.get("prompt", body.get("messages", [{}])[0].get("content")) == result_prompt:
            return times
    raise AssertionError(f"the server never saw {result_prompt!r}")


def test_every_metric_matches_the_servers_schedule():
    plan = Plan(ttft_s=0.3, itl_s=0.1, tokens_per_chunk=2)
    reqs = requests(4)
    with FakeOpenAIServer(lambda body: plan) as server:
        results, start, end, peak = run(server, reqs)
    assert peak == 4 and all(r.success for r in results)
    body = server.bodies[0]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["max_tokens"] == 5 and body["temperature"] == 0.0 and body["model"] == MODEL
    for req, r in zip(reqs, results):
        sent = sent_times(server, req.prompt)
        assert len(r.chunk_times) == 5  # the empty first chunk does not count
        assert all(0 <= got - at < SLACK_S for got, at in zip(r.chunk_times, sent))
        assert plan.ttft_s <= r.ttft < plan.ttft_s + SLACK_S
        assert r.itls == pytest.approx([plan.itl_s] * 4, abs=SLACK_S)
        assert r.output_len == 10 and r.prompt_len == 7  # from usage: 2 tokens a chunk; the server's prompt count
    s = summarize(results, start, end, peak)
    assert s["completed"] == 4 and s["failed"] == 0 and s["total_output_tokens"] == 40
    assert s["mean_ttft_ms"] == pytest.approx(300, abs=SLACK_S * 1000)
    assert s["mean_itl_ms"] == pytest.approx(100, abs=SLACK_S * 1000)
    # TPOT over tokens, not chunks: 4 gaps of 0.1 s spread over 9 tokens after the first
    assert s["mean_tpot_ms"] == pytest.approx(400 / 9, abs=SLACK_S * 1000 / 9 * 4)
    assert s["mean_e2el_ms"] == pytest.approx(700, abs=2 * SLACK_S * 1000)
    assert s["duration"] == pytest.approx(0.7, abs=0.2) and s["output_throughput"] == pytest.approx(40 / s["duration"])


def test_chat_stream_role_chunk_is_not_the_first_token_and_usage_missing_is_retokenized():
    with FakeOpenAIServer(lambda body: Plan(ttft_s=0.2, itl_s=0.05, send_usage=False, tokens_per_chunk=3)) as server:
        reqs = requests(2, output_len=4, text=True)
        results, *_ = run(server, reqs, endpoint="/v1/chat/completions", count_tokens=lambda t: len(t.split()))
        assert asyncio.run(first_model_id(server.url)) == MODEL
    assert sorted(b["messages"][0]["content"] for b in server.bodies) == ["prompt 0", "prompt 1"]
    assert server.bodies[0]["messages"][0]["role"] == "user"
    for r in results:
        assert r.success and r.ttft >= 0.2 and len(r.chunk_times) == 4
        assert r.output_len == 12 and r.prompt_len == 2  # re-tokenized text; the dataset's prompt length
    with FakeOpenAIServer(lambda body: Plan(send_usage=False)) as server:
        results, *_ = run(server, requests(1, output_len=3))
    assert results[0].output_len == 3  # no usage, no tokenizer: one token a chunk


def test_errors_are_counted_with_their_messages():
    plans = {100: Plan(status=429), 101: Plan(error_after=2), 102: Plan(num_chunks=0), 103: Plan()}
    with FakeOpenAIServer(lambda body: plans[body["prompt"][0]]) as server:
        results, start, end, peak = run(server, requests(4, output_len=3))
    assert [r.error for r in results] == ["HTTP 429: fake failure 429", "stream error: fake mid-stream failure",
                                          NO_CONTENT_ERROR, ""]
    s = summarize(results, start, end, peak)
    assert s["completed"] == 1 and s["failed"] == 3 and s["output_lens"] == [0, 0, 0, 3]
    assert sum(s["error_counts"].values()) == 3
    dead = ClientConfig(base_url=server.url, model=MODEL)  # the server is gone now
    [r], *_ = asyncio.run(run_requests(dead, requests(1)))
    assert not r.success and "ConnectError" in r.error


def test_arrivals_follow_the_schedule_and_max_concurrency_holds():
    plan = Plan(ttft_s=0.05, itl_s=0.01)
    reqs = requests(4, output_len=3, gap_s=0.25)
    with FakeOpenAIServer(lambda body: plan) as server:
        results, start, *_ = run(server, reqs)
        offsets = [r.start - start for r in results]
        assert offsets == pytest.approx([0, 0.25, 0.5, 0.75], abs=SLACK_S)
        results, start, end, peak = run(server, requests(4, output_len=3), max_concurrency=1)
    assert peak == 1
    ordered = sorted(results, key=lambda r: r.start)
    assert all(b.start >= a.chunk_times[-1] for a, b in zip(ordered, ordered[1:]))
