"""--kv-cache-dtype int8 on the default model: twice the blocks in the same memory, scored like the bf16
cache (bench perplexity holds the gate; here a 512-token window of the same text), and served end to end."""
import pytest
import torch

from servelab import LLM, SamplingParams
from servelab.bench.perplexity import TEXT
from servelab.engine.llm_engine import LLMEngine
from servelab.config import CacheConfig
from servelab.engine_args import EngineArgs
from servelab.entrypoints.cli import main


def test_a_kv_cache_dtype_servelab_does_not_have_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["serve", "--kv-cache-dtype", "fp8"])
    assert exit_info.value.code == 2
    assert "argument --kv-cache-dtype: invalid choice: 'fp8' (choose from 'auto', 'int8')" in capsys.readouterr().err
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, got 'fp8'"):
        CacheConfig(cache_dtype="fp8")


def prompt_logprobs(kv_cache_dtype: str, memory_gib: float = 1.0) -> tuple[LLMEngine, torch.Tensor, list[int]]:
    engine = LLMEngine.from_engine_args(EngineArgs(dtype="bfloat16", kv_cache_dtype=kv_cache_dtype, max_model_len=512,
                                                   kv_cache_memory=memory_gib))
    ids = engine.tokenizer.encode(TEXT.read_text(encoding="utf-8"))[:512]
    return engine, torch.log_softmax(engine.executor.prompt_logits(ids).double(), -1), ids


@pytest.mark.slow
def test_int8_kv_cache_holds_twice_the_blocks_and_scores_like_bf16():
    auto, auto_lp, ids = prompt_logprobs("auto")
    int8, int8_lp, _ = prompt_logprobs("int8")
    cfg = auto.executor.model.config
    cache = int8.executor.kv_caches[0]
    assert cache.dtype == torch.int8 and cache.shape[-1] == cfg.head_dim + 4
    # bytes per token: K and V rows of head_dim int8 values and a 4-byte scale, per KV head and layer
    per_token = cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * (cfg.head_dim + 4)
    assert int8.executor.num_blocks == (1 << 30) // (per_token * 16)
    assert auto.executor.num_blocks == (1 << 30) // (cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * cfg.head_dim
                                                      * 2 * 16)  # bf16
    targets = torch.tensor(ids[1:])[:, None]
    nll_auto, nll_int8 = (-lp[:-1].gather(1, targets).mean().item() for lp in (auto_lp, int8_lp))
    # measured: 2.723 vs 2.711 nats, 95.9% of the argmaxes equal, mean |delta logprob| 0.07
    assert abs(nll_int8 / nll_auto - 1) < 0.03
    assert (auto_lp.argmax(-1) == int8_lp.argmax(-1)).float().mean() > 0.9
    assert (auto_lp[:-1].gather(1, targets) - int8_lp[:-1].gather(1, targets)).abs().mean() < 0.15


@pytest.mark.slow
def test_int8_kv_cache_serves_a_batch_and_frees_its_blocks():
    """Batched decode (the fused kernels) and one sequence alone (the one-call decode step), same answers
    as far as greedy agrees with bf16's first tokens; every block back at the end."""
    prompts = ["The capital of France is", "def fibonacci(n):", "In 1905, Albert Einstein published"]
    greedy = SamplingParams(temperature=0, max_tokens=16)
    llm = LLM(dtype="bfloat16", kv_cache_dtype="int8", kv_cache_memory=0.25)
    batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
    assert llm.engine.executor.model._decode_runner is not None
    assert batched == alone
    reference = [o.outputs[0].token_ids for o in LLM(dtype="bfloat16", num_kv_blocks=256).generate(prompts, greedy)]
    assert [t[:2] for t in batched] == [t[:2] for t in reference]
    state = llm.engine.get_state()
    assert state.num_free_blocks == state.num_blocks
    llm.engine.check_invariants()
