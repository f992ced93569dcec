"""Structured output under tensor parallelism (`-tp 2`: the plan's bitmask reaches rank 0's sampler) and under
a prefill/decode split (`--disaggregate 1:1`: the prefill instance samples the first token under the grammar,
the decode instance's matcher goes on from it): greedy constrained outputs are token-identical to the offline
engine's, and valid."""
from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from servelab import LLM, SamplingParams
from servelab.sampling_params import StructuredOutputsParams
from servelab.testing.server import TINY_ENGINE_FLAGS

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "tags"], "properties": {
    "name": {"type": "string", "maxLength": 8},
    "tags": {"type": "array", "maxItems": 2, "items": {"enum": ["x", "y"]}}}}
PROMPTS = ["Hello, my name is", "The capital of France is", "Write JSON:"]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[str]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, num_threads=1)
    params = SamplingParams(temperature=0, max_tokens=60,
                            structured_outputs=StructuredOutputsParams("json", json.dumps(SCHEMA)))
    return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("flags", [("-tp", "2"), ("--disaggregate", "1:1")], ids=["tp2", "disaggregated"])
def test_constrained_outputs_match_the_offline_engine(start_server, tiny_llama_dir, reference, flags):
    server = start_server(tiny_llama_dir, *TINY_ENGINE_FLAGS, *flags)
    try:
        texts = []
        for prompt in PROMPTS:
            response = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "prompt": prompt, "max_tokens": 60, "temperature": 0, "guided_json": SCHEMA})
            assert response.status_code == 200, response.text
            texts.append(response.json()["choices"][0]["text"])
        assert texts == reference
        for text in texts:
            jsonschema.validate(json.loads(text), SCHEMA)
    finally:
        server.stop()
