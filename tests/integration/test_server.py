"""One shared tiny-model server: OpenAI semantics through the official client and raw httpx, error
paths, cancellation on disconnect, metrics, and greedy parity with LLM.generate."""
from __future__ import annotations

import asyncio
import json
import time

import httpx
import openai
import pytest

from servelab import LLM, SamplingParams
from servelab.testing.server import API_KEY, TINY_ENGINE_FLAGS, metric_values, parse_sse, wait_for_metrics

MODEL = "tiny-llama"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_REQUEST_BYTES = 65536
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,"]
REQUIRED_METRICS = [
    "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "num_preemptions_total",
    "prompt_tokens_total", "generation_tokens_total", "request_success_total", "time_to_first_token_seconds_count",
    "time_per_output_token_seconds_count", "request_time_per_output_token_seconds_count",
    "inter_token_latency_seconds_count", "e2e_request_latency_seconds_count",
    "request_queue_time_seconds_count", "iteration_tokens_total_count", "batch_slot_saturation",
    "kv_cache_reserved_unused_slots", "weight_bytes", "prefix_cache_queries_total", "prefix_cache_hits_total",
    "quantization_info",
]


@pytest.fixture(scope="module")
def server(start_server, tiny_llama_dir):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--api-key", API_KEY, "--api-key", "second-key",
                          "--served-model-name", MODEL, "tiny-alias", "--max-request-bytes", str(MAX_REQUEST_BYTES),
                          "--metrics-interval", "0.2")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=512, num_threads=1)


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kwargs)


def post(server, path: str, body, headers: dict | None = None, **kwargs) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(f"{server.url}{path}", content=content,
                      headers={"Content-Type": "application/json", **AUTH, **(headers or {})}, timeout=60, **kwargs)


def assert_error(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"]
    if code is not None:
        assert error["code"] == code
    if param is not None:
        assert error["param"] == param
    return error


# ---- endpoints and OpenAI semantics
def test_health_and_models(server, client):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert [m.id for m in client.models.list().data] == [MODEL, "tiny-alias"]


def test_greedy_completion_matches_llm_generate(client, llm):
    for prompt in PROMPTS:
        expected = llm.generate(prompt, greedy(24))[0].outputs[0]
        got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0)
        assert got.choices[0].text == expected.text
        assert got.usage.completion_tokens == len(expected.token_ids)
        assert got.choices[0].finish_reason == expected.finish_reason
        streamed = client.completions.create(model="tiny-alias", prompt=prompt, max_tokens=24, temperature=0,
                                             stream=True)
        assert "".join(chunk.choices[0].text for chunk in streamed) == expected.text


def test_greedy_chat_matches_llm_chat(client, llm):
    messages = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a color."}]
    expected = llm.chat(messages, greedy(20))[0].outputs[0]
    got = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == expected.text
    assert got.usage.completion_tokens == len(expected.token_ids)
    chunks = list(client.chat.completions.create(model=MODEL, messages=messages, max_tokens=20, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason == expected.finish_reason


def test_token_id_and_multi_prompt_completions(client, llm):
    ids = llm.get_tokenizer().encode(PROMPTS[0])
    expected = llm.generate({"prompt_token_ids": ids}, greedy(8))[0].outputs[0].text
    got = client.completions.create(model=MODEL, prompt=ids, max_tokens=8, temperature=0)
    assert got.choices[0].text == expected
    many = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=8, temperature=0)
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.text for c in many.choices] == [llm.generate(p, greedy(8))[0].outputs[0].text for p in PROMPTS]


def test_n_samples(client):
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=8, n=2, seed=7, temperature=1.0,
                                    extra_body={"ignore_eos": True})
    assert sorted(c.index for c in got.choices) == [0, 1]
    assert got.usage.completion_tokens == 16
    assert got.choices[0].text != got.choices[1].text
    texts, finished = {0: "", 1: ""}, []
    for chunk in client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, n=2, stream=True, seed=3,
                                                extra_body={"ignore_eos": True}):
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason:
            finished.append(choice.index)
    assert sorted(finished) == [0, 1]
    assert all(texts.values())


def test_stop_strings(client, llm):
    full = llm.generate(PROMPTS[1], greedy(24, ignore_eos=True))[0].outputs[0].text
    stop = full[6:9]
    expected = full[: full.index(stop)]
    got = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0, stop=[stop],
                                    extra_body={"ignore_eos": True})
    assert got.choices[0].text == expected
    assert got.choices[0].finish_reason == "stop"
    assert got.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=24, temperature=0,
                                              stop=stop, stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in streamed) == expected
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_logprobs(client):
    got = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=6, temperature=0, logprobs=2,
                                    extra_body={"ignore_eos": True})
    lp = got.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == got.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert logprob >= max(top.values()) - 1e-4  # greedy picks the most likely token
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                          temperature=0, logprobs=True, top_logprobs=3,
                                          extra_body={"ignore_eos": True})
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert "".join(entry.token for entry in content) == chat.choices[0].message.content


def test_sse_framing_done_and_usage_chunk(server):
    body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "stream": True, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    response = post(server, "/v1/completions", body)
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    payloads = parse_sse(response.text)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 5
    assert all(c["usage"] is None and c["object"] == "text_completion" for c in chunks[:-1])
    assert len({c["id"] for c in chunks}) == 1
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    # without include_usage there is no usage key and no usage chunk
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}],
                                                     "max_tokens": 3, "stream": True})
    chunks = [json.loads(p) for p in parse_sse(response.text)[:-1]]
    assert all("usage" not in c and c["object"] == "chat.completion.chunk" for c in chunks)
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}


# ---- error paths
def test_unauthorized(server):
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}, {"Authorization": "Basic test-key"}):
        assert_error(post(server, "/v1/completions", {"prompt": "x"}, headers=headers), 401, "invalid_api_key")
    assert_error(httpx.get(f"{server.url}/v1/models"), 401)
    second = {"Authorization": "Bearer second-key"}
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}, headers=second).status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0).models.list()
    assert httpx.get(f"{server.url}/metrics").status_code == 200  # open without --protect-metrics


def test_bad_requests(server):
    assert_error(post(server, "/v1/completions", "{not json"), 400)
    assert_error(post(server, "/v1/completions", "[1, 2]"), 400)
    assert_error(post(server, "/v1/completions", {"prompt": "x", "max_tokens": "10"}), 400, param="max_tokens")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "temperature": True}), 400, param="temperature")
    assert_error(post(server, "/v1/completions", {"max_tokens": 3}), 400, param="prompt")
    assert_error(post(server, "/v1/completions", {"prompt": "x", "temperature": -1}), 400, param="temperature")
    assert_error(post(server, "/v1/completions", {"prompt": [10**9]}), 400, param="prompt")
    assert_error(post(server, "/v1/chat/completions", {"messages": "hi"}), 400, param="messages")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}), 400,
                 param="messages[0].content")
    assert_error(post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                                                       "top_logprobs": 2}), 400, param="top_logprobs")
    # unknown fields are ignored, as OpenAI does
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1, "no_such_field": {"a": 1}}).status_code == 200


def test_context_length_errors_name_both_numbers(server, client):
    long_ids = [100] * 600
    error = assert_error(post(server, "/v1/completions", {"prompt": long_ids, "max_tokens": 4}), 400,
                         "context_length_exceeded", "prompt")
    assert "512" in error["message"] and "600" in error["message"] and "4" in error["message"]
    error = assert_error(post(server, "/v1/completions", {"prompt": [100] * 100, "max_tokens": 500}), 400,
                         "context_length_exceeded")
    assert all(str(n) in error["message"] for n in (512, 100, 500, 600))
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi " * 600}])


def test_unknown_model(server, client):
    assert_error(post(server, "/v1/completions", {"model": "gpt-4", "prompt": "x"}), 404, "model_not_found", "model")
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "x"}])


def test_request_too_large(server):
    big = {"prompt": "x" * (MAX_REQUEST_BYTES + 10), "max_tokens": 1}
    assert_error(post(server, "/v1/completions", big), 413, "request_too_large")

    def chunked():  # no Content-Length: the limit is enforced while reading
        data = json.dumps(big).encode()
        for i in range(0, len(data), 8192):
            yield data[i:i + 8192]

    response = httpx.post(f"{server.url}/v1/completions", content=chunked(),
                          headers={"Content-Type": "application/json", **AUTH}, timeout=60)
    assert "content-length" not in response.request.headers
    assert_error(response, 413, "request_too_large")


# ---- request ids and logs
def test_request_id_header_and_log_line(server):
    response = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True},
                    headers={"X-Request-Id": "client-id-42"})
    assert response.headers["x-request-id"] == "client-id-42"
    generated = post(server, "/v1/completions", {"prompt": "x", "max_tokens": 1}).headers["x-request-id"]
    assert generated and generated != "client-id-42"
    lines = [line for line in server.request_log_lines() if line["x_request_id"] == "client-id-42"]
    assert len(lines) == 1
    line = lines[0]
    assert line["request_id"] == response.json()["id"]
    assert (line["status"], line["prompt_tokens"], line["output_tokens"], line["finish_reason"]) == (200, 1, 3, "length")
    assert 0 < line["ttft_s"] <= line["e2e_s"]


# ---- cancellation
def test_disconnect_mid_stream_frees_kv_blocks(server):
    before = metric_values(server.url)
    body = {"prompt": PROMPTS[0], "max_tokens": 400, "ignore_eos": True, "stream": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{server.url}/v1/completions", json=body, headers=AUTH) as response:
            assert response.status_code == 200
            seen = 0
            for line in response.iter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    break
    abort_key = "servelab:request_success_total{finished_reason=abort}"
    values = wait_for_metrics(server.url, lambda v: v[abort_key] == before[abort_key] + 1
                              and v["servelab:kv_cache_usage_perc"] == 0
                              and v["servelab:num_requests_running"] == 0)
    assert values["servelab:kv_cache_num_free_blocks"] == values["servelab:kv_cache_num_blocks"]
    assert [line["status"] for line in server.request_log_lines()][-1] == 499


# ---- concurrency
def test_64_concurrent_streams_are_not_interleaved(server, llm):
    prompts = [f"Request number {i} says" for i in range(64)]
    expected = [o.outputs[0].text for o in llm.generate(prompts, greedy(12, ignore_eos=True), use_tqdm=False)]

    async def one(http: httpx.AsyncClient, prompt: str) -> tuple[set, str, str]:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
                "stream": True}
        response = await http.post(f"{server.url}/v1/completions", json=body, headers=AUTH)
        assert response.status_code == 200, response.text
        payloads = parse_sse(response.text)
        assert payloads[-1] == "[DONE]"
        chunks = [json.loads(p) for p in payloads[:-1]]
        return {c["id"] for c in chunks}, "".join(c["choices"][0]["text"] for c in chunks), \
            chunks[-1]["choices"][0]["finish_reason"]

    async def run_all():
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(timeout=120, limits=limits) as http:
            return await asyncio.gather(*(one(http, p) for p in prompts))

    results = asyncio.run(run_all())
    ids = [r[0] for r in results]
    assert all(len(i) == 1 for i in ids) and len(set().union(*ids)) == 64
    assert [r[1] for r in results] == expected
    assert all(r[2] == "length" for r in results)


# ---- metrics
def test_prometheus_metrics(server):
    assert post(server, "/v1/completions", {"prompt": "x", "max_tokens": 3, "ignore_eos": True}).status_code == 200
    values = wait_for_metrics(server.url, lambda v: v["servelab:time_to_first_token_seconds_count"] > 0)
    names = {key.split("{")[0] for key in values}
    for name in REQUIRED_METRICS:
        assert f"servelab:{name}" in names, name
    assert values["servelab:generation_tokens_total"] > 0 and values["servelab:prompt_tokens_total"] > 0
    assert values["servelab:time_to_first_token_seconds_count"] > 0
    assert values["servelab:request_success_total{finished_reason=length}"] > 0
    assert values["servelab:weight_bytes{device=cpu}"] > 0


def settled_prefix_counters(url: str) -> tuple[float, float]:
    """(queries, hits) once two scrapes a few metrics intervals apart agree (earlier tests' requests counted)."""
    last = None
    for _ in range(50):
        values = metric_values(url)
        now = (values["servelab:prefix_cache_queries_total"], values["servelab:prefix_cache_hits_total"])
        if now == last:
            return now
        last = now
        time.sleep(0.5)
    raise AssertionError("prefix cache counters never settled")


def test_prefix_cache_counters_count_a_repeated_prompt(server):
    queries, hits = settled_prefix_counters(server.url)
    prompt = list(range(1000, 1040))  # 40 tokens: 2 full blocks of 16 ahead of the last token
    for _ in range(2):  # one after the other: the first one's blocks are cached when the second arrives
        assert post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 1}).status_code == 200
    wait_for_metrics(server.url, lambda v: v["servelab:prefix_cache_queries_total"] >= queries + 80)
    assert settled_prefix_counters(server.url) == (queries + 80, hits + 32)


def test_metrics_stream(server):
    snapshots = []
    with httpx.Client(timeout=10) as http:
        with http.stream("GET", f"{server.url}/v1/metrics/stream") as response:
            assert response.headers["content-type"].startswith("text/event-stream")
            for line in response.iter_lines():
                if line.startswith("data: "):
                    snapshots.append(json.loads(line[len("data: "):]))
                if len(snapshots) == 2:
                    break
    assert 0.1 < snapshots[1]["time"] - snapshots[0]["time"] < 5
    for key in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "batch_slot_saturation",
                "kv_cache_reserved_unused_slots", "weight_bytes", "generation_tokens_per_s", "recent"):
        assert key in snapshots[1], key
