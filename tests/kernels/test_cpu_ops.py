"""servelab's CPU ops against the PyTorch reference ops they replace."""
import pytest
import torch
import torch.nn.functional as F

from servelab.kernels import cpu_ops
from servelab.model.attention import AttentionMetadata, decode_attention
from servelab.model.llama import _rotate_half, rms_norm

ops = cpu_ops()
pytestmark = pytest.mark.skipif(ops is None, reason="servelab CPU ops need AVX2+FMA and a C++ compiler")


@pytest.mark.parametrize("m,n,k", [(1, 960, 576), (1, 1003, 64), (1, 7, 32), (1, 9, 24), (3, 7, 24), (5, 100, 64), (37, 49, 13), (130, 96, 200)])
def test_linear_bf16w_matches_fp32_matmul(m, n, k):
    torch.manual_seed(m)
    x, w, b = torch.randn(m, k), torch.randn(n, k).bfloat16(), torch.randn(n)
    expected = F.linear(x, w.float(), b)
    torch.testing.assert_close(ops.linear_bf16w(x, w, b), expected, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(ops.linear_bf16w(x, w, None), F.linear(x, w.float()), rtol=1e-5, atol=1e-4)


def test_rms_norm_and_fused_add():
    torch.manual_seed(0)
    x, res, w = torch.randn(9, 64), torch.randn(9, 64), torch.randn(64)
    torch.testing.assert_close(ops.rms_norm(x, w, 1e-5), rms_norm(x, w, 1e-5), rtol=1e-5, atol=1e-5)
    xx, rr = x.clone(), res.clone()
    ops.add_rms_norm_(xx, rr, w, 1e-5)
    torch.testing.assert_close(rr, x + res)
    torch.testing.assert_close(xx, rms_norm(x + res, w, 1e-5), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache(cache_dtype):
    torch.manual_seed(0)
    heads, kv_heads, hd, tokens = 4, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd)
    positions = torch.tensor([0, 3, 7, 8, 20])
    angles = torch.arange(32)[:, None] * torch.rand(hd // 2)[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    cache = torch.zeros(2, 4, 8, kv_heads, hd, dtype=cache_dtype)
    slots = torch.tensor([1, 9, 10, 30, 31])
    expected = qkv.clone().view(tokens, -1, hd)
    c, s = cos[positions][:, None], sin[positions][:, None]
    qk = expected[:, : heads + kv_heads]
    expected[:, : heads + kv_heads] = qk * c + _rotate_half(qk) * s
    ops.rope_and_cache_(qkv, positions, cos, sin, heads, kv_heads, cache, slots)
    torch.testing.assert_close(qkv.view(tokens, -1, hd), expected, rtol=1e-5, atol=1e-5)
    flat = cache.view(2, -1, kv_heads, hd)
    torch.testing.assert_close(flat[0, slots].float(), expected[:, heads:heads + kv_heads].to(cache_dtype).float())
    torch.testing.assert_close(flat[1, slots].float(), expected[:, heads + kv_heads:].to(cache_dtype).float())
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert flat[:, untouched].abs().sum() == 0


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_attention_matches_reference(cache_dtype):
    torch.manual_seed(0)
    heads, kv_heads, hd, block = 6, 2, 16, 4
    cache = torch.randn(2, 10, block, kv_heads, hd).to(cache_dtype)
    tables = torch.tensor([[3, 7, 1], [9, 0, 0], [2, 4, 6]])
    lens = torch.tensor([11, 2, 12])
    q = torch.randn(3, heads * hd)
    mask = (torch.arange(3 * block)[None] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 3, tables, mask, lens, [])
    expected = decode_attention(q.view(3, heads, hd), cache, meta).reshape(3, -1)
    torch.testing.assert_close(ops.paged_decode_attention(q, cache, tables, lens, heads), expected,
                               rtol=1e-4, atol=1e-5)


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])
