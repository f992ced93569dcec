"""`servelab serve --speculative-config` over real HTTP: streamed greedy text identical to the engine without
speculation, and vLLM's spec-decode counters on /metrics."""
from __future__ import annotations

import json

import httpx

from servelab.testing.server import TINY_ENGINE_FLAGS, parse_sse, wait_for_metrics
from servelab import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2, "prompt_lookup_min": 1}
PROMPT = [500] * 20  # the tiny random model's greedy output after it repeats itself: drafts are accepted


def test_served_speculation_streams_the_same_text_and_counts_drafts(start_server, tiny_llama_dir):
    expected = LLM(str(tiny_llama_dir), dtype="float32").generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=40))[0].outputs[0].text
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, "--speculative-config", json.dumps(SPEC))
    body = {"prompt": PROMPT, "max_tokens": 40, "temperature": 0, "stream": True}
    response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    chunks = [json.loads(p) for p in parse_sse(response.text)[:-1]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == expected
    values = wait_for_metrics(server.url, lambda v: v.get("servelab:spec_decode_num_accepted_tokens_total", 0) > 0)
    drafts = values["servelab:spec_decode_num_drafts_total"]
    assert values["servelab:spec_decode_num_draft_tokens_total"] >= drafts > 0
    per_pos = [values[f"servelab:spec_decode_num_accepted_tokens_per_pos_total{{position={p}}}"] for p in range(3)]
    assert sum(per_pos) == values["servelab:spec_decode_num_accepted_tokens_total"]
    assert per_pos == sorted(per_pos, reverse=True)  # position j is reached only past j accepted drafts
    bad = httpx.post(f"{server.url}/v1/completions", json={**body, "stream": False, "temperature": 0.7}, timeout=120)
    assert bad.status_code == 200  # a sampled request decodes one token a step beside it
