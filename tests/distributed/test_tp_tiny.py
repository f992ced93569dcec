"""A tiny Llama sharded over 2 worker processes: greedy tokens identical to one process and to Hugging
Face transformers, with the KV heads split (GQA) and copied (MQA), through chunked prefill and
preemption; and bf16 through servelab's CPU ops on the shards."""
import multiprocessing

import pytest
import torch
from tp_helpers import greedy_token_ids, random_prompts

from servelab import LLM, SamplingParams
from servelab.executor.model_executor import ModelExecutor
from servelab.executor.multiproc_executor import MultiprocExecutor
from servelab.kernels import cpu_ops

NUM_NEW = 16
PROMPT_LENS = (1, 5, 17, 40)
# 6 blocks of 16 tokens cannot hold all four requests (11 blocks at full length): preemption by
# recompute; a 16-token budget prefills the 17- and 40-token prompts in chunks.
TIGHT = dict(num_kv_blocks=6, max_num_batched_tokens=16)


def hf_greedy(folder, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model.generate(torch.tensor([p]), max_new_tokens=NUM_NEW, do_sample=False,
                               pad_token_id=2)[0, len(p):].tolist() for p in prompts]


@pytest.mark.parametrize("folder_fixture", ["tiny_gqa_dir", "tiny_mqa_dir"])
def test_tp2_greedy_matches_tp1_and_hf(request, folder_fixture):
    folder = request.getfixturevalue(folder_fixture)
    prompts = random_prompts(PROMPT_LENS)
    expected = hf_greedy(folder, prompts)

    single = LLM(str(folder), dtype="float32", num_threads=1, **TIGHT)
    assert isinstance(single.engine.executor, ModelExecutor)
    assert greedy_token_ids(single, prompts, NUM_NEW) == expected
    assert multiprocessing.active_children() == []  # TP 1 starts no process

    llm = LLM(str(folder), dtype="float32", tensor_parallel_size=2, **TIGHT)
    try:
        assert isinstance(llm.engine.executor, MultiprocExecutor)
        assert len(llm.engine.executor.worker_pids) == 2
        assert greedy_token_ids(llm, prompts, NUM_NEW) == expected
        state = llm.engine.get_state()
        assert state.num_preemptions_total > 0
        assert state.num_free_blocks == state.num_blocks
    finally:
        llm.shutdown()
    assert multiprocessing.active_children() == []


@pytest.mark.skipif(cpu_ops() is None, reason="servelab CPU ops need AVX2+FMA and a C++ compiler")
def test_tp2_bf16_matches_tp1_bf16(tiny_gqa_dir):
    # Greedy tokens equal; logprobs equal up to the order of the fp32 sums (two partial products per
    # row-parallel matmul, added by the all-reduce).
    prompts = random_prompts(PROMPT_LENS, seed=1)
    params = SamplingParams(temperature=0, max_tokens=NUM_NEW, logprobs=1)
    single = LLM(str(tiny_gqa_dir), dtype="bfloat16", num_threads=1, num_kv_blocks=64)
    expected = single.generate([{"prompt_token_ids": p} for p in prompts], params)
    llm = LLM(str(tiny_gqa_dir), dtype="bfloat16", tensor_parallel_size=2, num_kv_blocks=64)
    try:
        got = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    finally:
        llm.shutdown()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
    worst = max(abs(a.logprob - b.logprob) for x, y in zip(expected, got)
                for a, b in zip(x.outputs[0].logprobs, y.outputs[0].logprobs))
    print(f"worst bf16 TP 2 vs TP 1 logprob gap: {worst:.2e}")
    assert worst < 1e-2
