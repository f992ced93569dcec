"""Structured output inside the engine, offline on a tiny random-weight Llama: constrained outputs match their
grammar and are token-identical across every schedule and with or without prefix caching (the mask depends
only on a request's own tokens); a request whose grammar is still compiling waits outside the scheduler while
the batch goes on; the bitmask rows reach the sampler in the plan's order."""
from __future__ import annotations

import json
import threading

import jsonschema
import pytest

from servelab import LLM, SamplingParams
from servelab.sampling_params import StructuredOutputsParams

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "n"], "properties": {
    "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer", "minimum": 0, "maximum": 99}}}
PROMPTS = ["Hello, my name is", "The capital of France is", "1, 2, 3, 4,", "Hello, my name is"]
GRAMMARS = [StructuredOutputsParams("json", json.dumps(SCHEMA)), StructuredOutputsParams("regex", "[a-z]{3}-[0-9]{2}"),
            StructuredOutputsParams("choice", '["left", "right"]'), StructuredOutputsParams("json", json.dumps(SCHEMA))]


def constrained(grammar: StructuredOutputsParams, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=60, structured_outputs=grammar, **kwargs)


def run(llm: LLM, **kwargs) -> list[list[int]]:
    params = [constrained(g, temperature=0) for g in GRAMMARS] + [SamplingParams(temperature=0, max_tokens=8)]
    outputs = llm.generate(PROMPTS + ["plain"], params)
    llm.engine.check_invariants()
    texts = [o.outputs[0].text for o in outputs]
    jsonschema.validate(json.loads(texts[0]), SCHEMA)
    jsonschema.validate(json.loads(texts[3]), SCHEMA)
    assert len(texts[1]) == 6 and texts[1][3] == "-" and texts[1][4:].isdigit()
    assert texts[2] in ("left", "right")
    assert all(o.outputs[0].finish_reason == "stop" for o in outputs[:4])
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def reference(tiny_llama_dir) -> list[list[int]]:
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, num_threads=1, enable_prefix_caching=False)
    return run(llm)


@pytest.mark.parametrize("engine_kwargs", [
    dict(schedule="serial"), dict(schedule="static"), dict(schedule="continuous", enable_prefix_caching=True),
    dict(schedule="continuous", max_num_batched_tokens=4, enable_prefix_caching=True)],
    ids=["serial", "static", "continuous-prefix-cache", "chunked-prefill"])
def test_token_identical_in_every_schedule(tiny_llama_dir, reference, engine_kwargs):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, num_threads=1, **engine_kwargs)
    assert run(llm) == reference
    assert run(llm) == reference  # again, now from the prefix cache and the compiled-grammar cache


def test_sampled_outputs_match_and_logprobs_describe_the_model(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, num_threads=1)
    outputs = llm.generate(["Write JSON:"] * 6, [constrained(GRAMMARS[0], temperature=1.0, seed=i, logprobs=2)
                                                  for i in range(6)])
    for output in outputs:
        jsonschema.validate(json.loads(output.outputs[0].text), SCHEMA)
        assert all(lp.logprob > float("-inf") for lp in output.outputs[0].logprobs)


def gated_engine(tiny_llama_dir):
    """An engine whose grammars cannot compile until the returned event is set."""
    engine = LLM(str(tiny_llama_dir), dtype="float32", num_kv_blocks=256, num_threads=1).engine
    gate = threading.Event()
    build = engine.grammars._tokenizer_factory
    engine.grammars._tokenizer_factory = lambda: (gate.wait(60), build())[1]
    return engine, gate


def test_a_compiling_grammar_does_not_hold_up_the_batch(tiny_llama_dir):
    engine, gate = gated_engine(tiny_llama_dir)
    plain, waiting = (engine.input_processor.process_inputs(request_id, "Hello", params) for request_id, params in (
        ("plain", SamplingParams(temperature=0, max_tokens=4)), ("waiting", constrained(GRAMMARS[2], temperature=0))))
    engine.add_request(waiting)
    engine.add_request(plain)
    finished = {}
    for _ in range(6):
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert list(finished) == ["plain"] and [r.request_id for r in engine.core.grammar_waiting] == ["waiting"]
    gate.set()
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
    assert finished["waiting"].outputs[0].text in ("left", "right")
    engine.check_invariants()


def test_an_aborted_waiting_request_ends(tiny_llama_dir):
    engine, gate = gated_engine(tiny_llama_dir)
    engine.add_request(engine.input_processor.process_inputs("w", "Hello", constrained(GRAMMARS[1])))
    outputs = engine.abort_request("w")
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"] and not engine.has_unfinished_requests()
    gate.set()
