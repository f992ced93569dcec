"""--quantization int8 under tensor parallelism: every rank takes its part of the single-rank int8 weights (from the
cache), row-parallel products quantize each row with the maximum over all ranks and all-reduce integers, so greedy
tokens are identical at TP 1 and TP 2 (tiny Llama, bf16 activations through servelab's kernels, int8 KV cache)."""
import pytest
from tp_helpers import random_prompts

from servelab import LLM, SamplingParams

PROMPT_LENS = (1, 5, 16, 17, 40)
FLAGS = dict(dtype="bfloat16", quantization="int8", kv_cache_dtype="int8", num_kv_blocks=128, max_model_len=256)


def test_int8_greedy_tokens_are_identical_at_tp1_and_tp2(tiny_llama_dir):
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENS)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tp1 = LLM(str(tiny_llama_dir), num_threads=1, **FLAGS)
    expected = [o.outputs[0].token_ids for o in tp1.generate(prompts, params)]
    del tp1
    tp2 = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **FLAGS)  # its ranks read the int8 weights TP 1 cached
    try:
        got = [o.outputs[0].token_ids for o in tp2.generate(prompts, params)]
    finally:
        tp2.shutdown()
    assert got == expected


def test_tp2_ranks_calibrate_on_an_empty_cache_as_one_rank_would(tiny_llama_dir, tmp_path, monkeypatch):
    """No cache entry: each TP 2 rank calibrates a single-rank copy and caches it; TP 1 then reads that entry and
    gives the same tokens."""
    monkeypatch.setenv("SERVELAB_CACHE_DIR", str(tmp_path))
    prompts = [{"prompt_token_ids": p} for p in random_prompts(PROMPT_LENS, seed=1)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tp2 = LLM(str(tiny_llama_dir), tensor_parallel_size=2, **FLAGS)
    try:
        got = [o.outputs[0].token_ids for o in tp2.generate(prompts, params)]
    finally:
        tp2.shutdown()
    assert len(list((tmp_path / "quant").glob("int8-*.safetensors"))) == 1
    tp1 = LLM(str(tiny_llama_dir), num_threads=1, **FLAGS)
    assert [o.outputs[0].token_ids for o in tp1.generate(prompts, params)] == got
