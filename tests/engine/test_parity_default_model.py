"""test_parity.py's tests on the default model (SmolLM2-135M-Instruct's real weights, converted from its GGUF):
greedy token ids identical to Hugging Face transformers in every schedule. The schedules and the prefix cache are
exercised with all of test_parity.py's prompts on the tiny models (the prefix cache's block arithmetic does not
depend on the weights); here three prompts (1, 17 and 100 tokens: a single token, one past a block boundary,
several full blocks) check the real weights in each schedule."""
import pytest

from test_parity import parity_case, test_greedy_matches_hf  # noqa: F401

PROMPT_LENS = [1, 17, 100]


@pytest.fixture(scope="module")
def model_case(default_model_dir):
    return parity_case(default_model_dir, PROMPT_LENS)
