"""The default model (SmolLM2-135M: 9 heads, 3 KV heads, tied embeddings) over 3 worker processes
in fp32: the same greedy tokens as one process, and a third of its weights per rank."""
import pytest
from tp_helpers import random_prompts

from servelab import LLM, SamplingParams

pytestmark = pytest.mark.slow

NUM_NEW = 16
PROMPT_LENS = (1, 3, 8, 15, 16, 17, 40, 100)
# A row-parallel matmul adds three partial dot products (one per rank) in the all-reduce instead of
# one long sum, so logits move by float rounding only: ~3e-5 in logprob was the worst seen.
LOGPROB_TOLERANCE = 1e-3


@pytest.fixture(scope="module")
def tp1(default_model_dir):
    return LLM(str(default_model_dir), dtype="float32", num_threads=1, num_kv_blocks=256)


@pytest.fixture(scope="module")
def tp3(default_model_dir):
    llm = LLM(str(default_model_dir), dtype="float32", tensor_parallel_size=3, num_kv_blocks=256)
    yield llm
    llm.shutdown()


def test_tp3_greedy_tokens_match_tp1(tp1, tp3):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENS)]
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, ignore_eos=True, logprobs=1)
    expected, got = tp1.generate(prompts, params), tp3.generate(prompts, params)
    assert [len(o.outputs[0].token_ids) for o in got] == [NUM_NEW] * len(PROMPT_LENS)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    worst = max(abs(a.logprob - b.logprob) for x, y in zip(expected, got)
                for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs))
    print(f"worst TP 3 vs TP 1 logprob gap of the greedy tokens: {worst:.2e}")
    assert worst < LOGPROB_TOLERANCE


def test_tp3_weight_bytes_per_rank_are_a_third_plus_the_norms(tp1, tp3):
    config = tp1.engine.config.model
    [full] = tp1.engine.executor.weight_bytes_per_rank
    assert full == config.num_params * 4
    norm_bytes = (2 * config.num_hidden_layers + 1) * config.hidden_size * 4  # replicated on every rank
    per_rank = (full - norm_bytes) // 3 + norm_bytes
    assert (full - norm_bytes) % 3 == 0
    assert tp3.engine.executor.weight_bytes_per_rank == (per_rank,) * 3
    assert tp3.engine.executor.weight_bytes == 3 * per_rank
