"""Prompt-lookup speculation on real models: greedy outputs token-identical to decoding without it, with
drafts accepted on prompts whose continuation repeats them, and the KV cache whole afterwards."""
import pytest

from servelab import LLM, SamplingParams

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
TEXTS = [
    "Copy this list exactly: apple, banana, cherry, apple, banana, cherry, apple, banana, cherry, apple, banana,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a",
    "The capital of France is",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22",
]


@pytest.fixture(scope="module", params=["tiny_llama_dir", "default_model_dir"])
def model_dir(request):
    return request.getfixturevalue(request.param)


def generate(folder, **kwargs):
    llm = LLM(str(folder), dtype="float32", **kwargs)
    params = [SamplingParams(temperature=0, max_tokens=n) for n in (40, 33, 24, 40)]
    outputs = llm.generate(TEXTS, params)
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    state = engine.get_state()
    assert state.num_free_blocks == state.num_blocks
    engine.check_invariants()
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].finish_reason for o in outputs], engine


@pytest.mark.parametrize("budget", [1024, 6])
def test_greedy_identical_with_speculation(model_dir, budget):
    expected, reasons, _ = generate(model_dir, max_num_batched_tokens=budget)
    got, got_reasons, engine = generate(model_dir, max_num_batched_tokens=budget, speculative_config=SPEC)
    assert got == expected and got_reasons == reasons
    scheduler = engine._scheduler
    assert scheduler.spec_num_drafts_total > 0 and scheduler.spec_num_accepted_tokens_total > 0
    assert sum(scheduler.spec_num_accepted_tokens_per_pos) == scheduler.spec_num_accepted_tokens_total
