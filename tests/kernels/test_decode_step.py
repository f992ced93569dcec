"""The one-call decode step (DecodeRunner) against the op-by-op fused path it replaces at batch 1,
and its LM head against a plain matmul."""
import pytest
import torch
import torch.nn.functional as F

from servelab.kernels import cpu_ops
from servelab.model.attention import AttentionMetadata, dequantize_kv
from servelab.model.llama import LlamaForCausalLM
from servelab.specs import ModelSpec

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="servelab CPU ops need AVX2+FMA and a C++ compiler")
BLOCK_SIZE = 4


def random_model(bias: bool) -> LlamaForCausalLM:
    cfg = ModelSpec(id="random", name="random", architecture="LlamaForCausalLM", vocab_size=300, hidden_size=64,
                    intermediate_size=96, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                    head_dim=16, max_position_embeddings=64, attention_bias=bias)
    g = torch.Generator().manual_seed(int(bias))
    rand = lambda *shape, scale=0.2, offset=0.0: torch.randn(*shape, generator=g) * scale + offset  # noqa: E731
    sd = {"embed_tokens.weight": rand(300, 64, scale=1.0), "norm.weight": rand(64, offset=1.0),
          "lm_head.weight": rand(300, 64)}
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        sd |= {p + "input_layernorm.weight": rand(64, offset=1.0), p + "post_attention_layernorm.weight": rand(64, offset=1.0),
               p + "self_attn.q_proj.weight": rand(96, 64), p + "self_attn.k_proj.weight": rand(32, 64),
               p + "self_attn.v_proj.weight": rand(32, 64), p + "self_attn.o_proj.weight": rand(64, 96),
               p + "mlp.gate_proj.weight": rand(96, 64), p + "mlp.up_proj.weight": rand(96, 64),
               p + "mlp.down_proj.weight": rand(64, 96)}
        if bias:
            sd |= {p + f"self_attn.{n}_proj.bias": rand(size) for n, size in (("q", 96), ("k", 32), ("v", 32))}
    model = LlamaForCausalLM(cfg, torch.bfloat16, max_positions=64)
    model.load_weights(sd)
    return model


@pytest.mark.parametrize("bias,cache_dtype", [(False, "auto"), (True, "auto"), (False, "int8")])
def test_decode_runner_matches_op_by_op_path(bias, cache_dtype):
    """bf16 or int8 (--kv-cache-dtype) caches: the runner writes and reads them as the batched ops do."""
    model = random_model(bias)
    runner = model._decode_runner
    assert runner is not None
    cfg = model.config
    block_table = torch.tensor([[5, 2, 7, 0]])  # non-contiguous blocks, room for 16 tokens
    caches = [torch.zeros(model.kv_cache_shape(8, BLOCK_SIZE, cache_dtype), dtype=model.kv_cache_dtype(cache_dtype))
              for _ in range(cfg.num_hidden_layers)]
    expected_caches = [c.clone() for c in caches]
    tokens = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    with torch.inference_mode():
        for pos, token in enumerate(tokens):
            slot = block_table[0, pos // BLOCK_SIZE].item() * BLOCK_SIZE + pos % BLOCK_SIZE
            positions = torch.tensor([pos])
            meta = AttentionMetadata(torch.tensor([slot]), 1, block_table, None, positions + 1, [])
            x = F.embedding(torch.tensor([token]), model.embed_tokens).float()
            expected = model._forward_fused(x, positions, expected_caches, meta)
            got = runner.forward(token, pos, slot, block_table, caches)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            # The model takes the runner for a single decode row.
            torch.testing.assert_close(model(torch.tensor([token]), positions, [c.clone() for c in caches], meta),
                                       got, rtol=0, atol=0)
            torch.testing.assert_close(model.compute_logits(got), F.linear(got, model.lm_head.float()),
                                       rtol=1e-5, atol=1e-4)
    if cache_dtype == "int8":
        assert caches[0].dtype == torch.int8 and caches[0].shape[-1] == 16 + 4
        caches, expected_caches = ([dequantize_kv(c, torch.float32) for c in cs] for cs in (caches, expected_caches))
        assert all(c.abs().sum() > 0 for c in caches)
    for c, e in zip(caches, expected_caches):
        torch.testing.assert_close(c.float(), e.float(), rtol=1e-2, atol=1e-2)


def test_decode_runner_rejects_bad_inputs():
    model = random_model(False)
    caches = [torch.zeros(2, 8, BLOCK_SIZE, 2, 16, dtype=torch.bfloat16) for _ in range(3)]
    table = torch.tensor([[1]])
    with pytest.raises(RuntimeError, match="out of range"):
        model._decode_runner.forward(300, 0, 4, table, caches)
    with pytest.raises(RuntimeError, match="block table too short"):
        model._decode_runner.forward(1, 4, 4, table, caches)
    with pytest.raises(RuntimeError, match="one KV cache per layer"):
        model._decode_runner.forward(1, 0, 4, table, caches[:2])
