"""Greedy token ids identical to Hugging Face transformers, for the same weights, in every schedule: the tiny
random-weight Llama and Qwen2 here, the default model in test_parity_default_model.py (the same tests)."""
import pytest
import torch

from servelab import LLM, SamplingParams

NUM_NEW = 32
PROMPT_LENS = [1, 3, 8, 15, 16, 17, 40, 100]

SCHEDULES = {
    "serial": dict(schedule="serial"),
    "static": dict(schedule="static", max_num_seqs=3),
    "continuous": dict(schedule="continuous"),
    # 12 blocks of 16 tokens cannot hold 8 requests of up to 132 tokens: forces preemption by recompute.
    "preempt": dict(schedule="continuous", num_kv_blocks=12),
    # a 7-token budget splits every longer prompt into chunks that attend to cached context.
    "chunked": dict(schedule="continuous", max_num_batched_tokens=7),
}


def make_prompts(vocab_size, prompt_lens=PROMPT_LENS, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, min(vocab_size, 30000), (n,), generator=g).tolist() for n in prompt_lens]


def hf_greedy(folder, prompts):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    outs = []
    with torch.inference_mode():
        for p in prompts:
            gen = model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False,
                                 pad_token_id=model.generation_config.eos_token_id or 0)
            outs.append(gen[0, len(p):].tolist())
    return outs


def parity_case(folder, prompt_lens=PROMPT_LENS):
    """(folder, prompts, HF's greedy tokens for each prompt)"""
    from servelab.model.loader import load_model_config
    prompts = make_prompts(load_model_config(folder).vocab_size, prompt_lens)
    return folder, prompts, hf_greedy(folder, prompts)


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir"])
def model_case(request):
    return parity_case(request.getfixturevalue(request.param))


def assert_engine_clean(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    state = engine.get_state()
    assert state.num_free_blocks == state.num_blocks
    engine.check_invariants()


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_greedy_matches_hf(model_case, schedule):
    folder, prompts, expected = model_case
    llm = LLM(str(folder), dtype="float32", **{"num_kv_blocks": 256, **SCHEDULES[schedule]})
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0, max_tokens=NUM_NEW))
    got = [o.outputs[0].token_ids for o in outputs]
    # HF stops at EOS (and includes it); so does servelab.
    assert got == expected
    if schedule == "preempt":
        assert llm.engine.get_state().num_preemptions_total > 0
    assert_engine_clean(llm)


def test_prefix_cache_hits_match_hf(model_case):
    """Requests starting from cached blocks give HF's tokens: the same prompts again (each hits its own
    full blocks, short of its last token), and new prompts sharing a prefix with one that ran."""
    folder, prompts, expected = model_case
    longest = prompts[-1]  # 100 tokens: 6 full blocks
    other = next(p for p in prompts if len(p) >= 17)  # its first 9 tokens differ from longest's 49th on
    shared = [longest[:48] + other[:9], longest[:40]]  # 3 cached blocks + 9 new tokens; 2 blocks + 8
    llm = LLM(str(folder), dtype="float32", num_kv_blocks=256)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW)
    first = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    assert [o.outputs[0].token_ids for o in first] == expected
    state = llm.engine.get_state()
    assert (state.prefix_cache_queries_total, state.prefix_cache_hits_total) == (sum(map(len, prompts)), 0)
    again = llm.generate([{"prompt_token_ids": p} for p in prompts + shared], params)
    assert [o.outputs[0].token_ids for o in again] == expected + hf_greedy(folder, shared)
    hits = llm.engine.get_state().prefix_cache_hits_total
    # each prompt again: its full blocks short of the last token; the new ones: 3 and 2 blocks of `longest`
    assert hits == sum((len(p) - 1) // 16 * 16 for p in prompts) + 48 + 32
    assert_engine_clean(llm)
