"""The one-call decode step (DecodeRunner) against the op-by-op fused path it replaces at batch 1,
and its LM head against a plain matmul."""
import pytest
import torch
import torch.nn.functional as F

from servelab.kernels import cpu_ops
from servelab.model.attention import AttentionMetadata, dequantize_kv
from servelab.model.llama import LlamaForCausalLM
from servelab.model.quant.quantization import GGUFWeight
from servelab.specs import ModelSpec

pytestmark = pytest.mark.skipif(cpu_ops() is None, reason="servelab CPU ops need AVX2+FMA and a C++ compiler")
BLOCK_SIZE = 4


def random_model(bias: bool, gguf_type: int | None = None) -> LlamaForCausalLM:
    """bf16 weights, or (gguf_type) every matrix quantized to that GGUF type with gguf-py."""
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
    if gguf_type is not None:
        from gguf import GGMLQuantizationType
        from gguf.quants import quantize

        for name, w in list(sd.items()):
            if w.dim() == 2:
                blocks = quantize(w.numpy(), GGMLQuantizationType(gguf_type))
                sd[name] = GGUFWeight(torch.from_numpy(blocks), gguf_type, w.shape[1])
    model = LlamaForCausalLM(cfg, torch.bfloat16, max_positions=64, quantization=None if gguf_type is None else "gguf")
    model.load_weights(sd)
    return model


def decode_steps(tokens: list[int], block_table: torch.Tensor):
    """(token, position, slot, positions, metadata) of one sequence decoding tokens over block_table."""
    for pos, token in enumerate(tokens):
        slot = block_table[0, pos // BLOCK_SIZE].item() * BLOCK_SIZE + pos % BLOCK_SIZE
        positions = torch.tensor([pos])
        yield token, pos, slot, positions, AttentionMetadata(torch.tensor([slot]), 1, block_table, None, positions + 1, [])


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
        for token, pos, slot, positions, meta in decode_steps(tokens, block_table):
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


@pytest.mark.parametrize("gguf_type", [2, 3, 8], ids=["Q4_0", "Q4_1", "Q8_0"])
def test_decode_runner_on_gguf_blocks_matches_op_by_op_path(gguf_type):
    """GGUF matrices with inputs rounded to 8 bits: Q4_0 / Q4_1 of 64 columns run repacked (q4_packed.h),
    down_proj's 96 columns and Q8_0 as stored; the op-by-op path's linear_gguf rounds the same way."""
    model = random_model(False, gguf_type)
    runner = model._decode_runner
    assert runner is not None and model.layers[0].qkv_proj.quantized.int8_inputs
    cfg = model.config
    block_table = torch.tensor([[3, 1, 0, 2]])
    caches = [torch.zeros(model.kv_cache_shape(8, BLOCK_SIZE), dtype=model.kv_cache_dtype())
              for _ in range(cfg.num_hidden_layers)]
    expected_caches = [c.clone() for c in caches]
    tokens = torch.randint(0, cfg.vocab_size, (9,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.inference_mode():
        for token, pos, slot, positions, meta in decode_steps(tokens, block_table):
            expected = model._forward_fused(model.embedding(torch.tensor([token])).float(), positions,
                                            expected_caches, meta)
            got = runner.forward(token, pos, slot, block_table, caches)
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
            torch.testing.assert_close(model.compute_logits(got), model.head.compute_logits(got), rtol=1e-5, atol=1e-4)


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
