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
# the tiny random model's greedy output after a repeated token repeats itself: drafts hit there too
PROMPTS = TEXTS + [{"prompt_token_ids": [500] * 20}]


def generate(folder, prompts, max_tokens, **kwargs):
    llm = LLM(str(folder), dtype="float32", **kwargs)
    outputs = llm.generate(prompts, [SamplingParams(temperature=0, max_tokens=n) for n in max_tokens])
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    state = engine.get_state()
    assert state.num_free_blocks == state.num_blocks
    engine.check_invariants()
    return [o.outputs[0].token_ids for o in outputs], [o.outputs[0].finish_reason for o in outputs], engine


def check_identical(folder, prompts, max_tokens, **kwargs):
    expected, reasons, _ = generate(folder, prompts, max_tokens, **kwargs)
    got, got_reasons, engine = generate(folder, prompts, max_tokens, speculative_config=SPEC, **kwargs)
    assert got == expected and got_reasons == reasons
    state = engine.get_state()
    assert state.spec_num_drafts_total > 0 and state.spec_num_accepted_tokens_total > 0
    assert sum(state.spec_num_accepted_tokens_per_pos) == state.spec_num_accepted_tokens_total


@pytest.mark.parametrize("budget", [1024, 6])  # 6: drafts cut to the budget, prompts chunked beside them
def test_greedy_identical_with_speculation_tiny(tiny_llama_dir, budget):
    check_identical(tiny_llama_dir, PROMPTS, (40, 33, 24, 40, 60), max_num_batched_tokens=budget)


def test_greedy_identical_with_speculation_default_model(default_model_dir):
    # the two prompts whose answers copy the prompt (a list, code): drafts hit
    check_identical(default_model_dir, TEXTS[:2], (32, 32))


def test_lab_profile_measures_acceptance(tiny_llama_dir):
    """`lab profile --spec-acceptance-only`'s measurement: the counts agree with each other and the fitted rate
    gives the measured tokens per decode step."""
    from servelab.bench.grounded_prompts import code_edit_prompts
    from servelab.config import SpeculativeConfig
    from servelab.lab.calibrate.spec_acceptance import measure_acceptance, tokens_per_step

    llm = LLM(str(tiny_llama_dir), dtype="float32", speculative_config=SPEC)
    short = code_edit_prompts(4)[2:]  # two short functions: within the tiny model's 512 positions
    m = measure_acceptance(llm.engine, SpeculativeConfig(**SPEC), short, max_tokens=24)
    assert m["num_decode_tokens"] <= 2 * 23 and m["num_decode_steps"] >= m["num_drafts"] > 0
    assert m["num_draft_tokens"] >= m["num_drafts"]
    assert abs(tokens_per_step(m["fitted_acceptance_rate"], 4) - m["tokens_per_decode_step"]) < 1e-6
