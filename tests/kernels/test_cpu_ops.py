"""servelab's CPU ops against the PyTorch reference ops they replace."""
import pytest
import torch
import torch.nn.functional as F

from servelab.kernels import cpu_ops
from servelab.model.attention import (AttentionMetadata, PrefillChunk, decode_attention, prefill_attention,
                                      quantize_kv)
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


def random_cache(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A KV cache of random values: int8 as --kv-cache-dtype int8 stores them (rows of head_dim + 4 bytes)."""
    x = torch.randn(*shape)
    return quantize_kv(x) if dtype == torch.int8 else x.to(dtype)


def cached_rows(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """What a cache of dtype holds for the rows x, as bytes for int8 (compared exactly)."""
    return quantize_kv(x) if dtype == torch.int8 else x.to(dtype).float()


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_rope_and_cache(cache_dtype):
    """The rotated q and k, and the cache rows written at the slots; int8 rows byte for byte as
    attention.py's quantize_kv writes them (values and the fp32 scale after them)."""
    torch.manual_seed(0)
    heads, kv_heads, hd, tokens = 4, 2, 16, 5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * hd)
    qkv[2, (heads + 1) * hd:(heads + 2) * hd] = 0  # a k row of zeros: scale 0, values 0
    positions = torch.tensor([0, 3, 7, 8, 20])
    angles = torch.arange(32)[:, None] * torch.rand(hd // 2)[None]
    cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
    row = hd + (4 if cache_dtype == torch.int8 else 0)
    cache = torch.zeros(2, 4, 8, kv_heads, row, dtype=cache_dtype)
    slots = torch.tensor([1, 9, 10, 30, 31])
    expected = qkv.clone().view(tokens, -1, hd)
    c, s = cos[positions][:, None], sin[positions][:, None]
    qk = expected[:, : heads + kv_heads]
    expected[:, : heads + kv_heads] = qk * c + _rotate_half(qk) * s
    ops.rope_and_cache_(qkv, positions, cos, sin, heads, kv_heads, cache, slots)
    torch.testing.assert_close(qkv.view(tokens, -1, hd), expected, rtol=1e-5, atol=1e-5)
    flat = cache.view(2, -1, kv_heads, row)
    got_k, got_v = (flat[i, slots] if cache_dtype == torch.int8 else flat[i, slots].float() for i in (0, 1))
    # the cache holds the kernel's own rotated k (checked above to rtol 1e-5) and v, as quantize_kv writes them
    rotated = qkv.view(tokens, -1, hd)
    want_k = cached_rows(rotated[:, heads:heads + kv_heads], cache_dtype)
    want_v = cached_rows(rotated[:, heads + kv_heads:], cache_dtype)
    if cache_dtype == torch.int8:  # byte for byte: values and the fp32 scale after them
        assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
        assert torch.equal(got_k[2, 1], torch.zeros(row, dtype=torch.int8))
    else:
        torch.testing.assert_close(got_k, want_k, rtol=0, atol=0)
        torch.testing.assert_close(got_v, want_v, rtol=0, atol=0)
    untouched = torch.ones(32, dtype=torch.bool)
    untouched[slots] = False
    assert flat[:, untouched].abs().sum() == 0


# (heads, kv_heads, head_dim, block_size, context lengths): few sequences take one task per KV head,
# many (at least two per thread) one task per sequence; contexts cover whole and partial 8-token chunks,
# the K prefetch two chunks ahead (over 24 tokens), group sizes of 1-4 and head_dims with a 32-value tail.
ATTENTION_SHAPES = [
    (6, 2, 16, 4, [11, 2, 12]),
    (9, 3, 64, 16, [140, 1, 8, 23, 24, 25, 64, 97, 3]),
    (8, 2, 40, 8, [33, 7, 16, 50, 1, 9]),
    (4, 4, 32, 16, [5, 40, 17, 31, 64]),
    (8, 1, 64, 16, [70]),
]


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request):
    """Sequences per thread decide the kernel's task split: run both splits whatever the machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads,kv_heads,hd,block,lens", ATTENTION_SHAPES)
def test_paged_decode_attention_matches_reference(cache_dtype, heads, kv_heads, hd, block, lens, torch_threads):
    torch.manual_seed(0)
    max_blocks = -(-max(lens) // block)
    num_blocks = len(lens) * max_blocks + 3
    cache = random_cache((2, num_blocks, block, kv_heads, hd), cache_dtype)
    tables = torch.randperm(num_blocks)[:len(lens) * max_blocks].view(len(lens), max_blocks)
    lens = torch.tensor(lens)
    q = torch.randn(len(lens), heads * hd)
    mask = (torch.arange(max_blocks * block)[None] < lens[:, None])[:, None, None, :]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), len(lens), tables, mask, lens, [])
    expected = decode_attention(q.view(len(lens), heads, hd), cache, meta).reshape(len(lens), -1)
    got = ops.paged_decode_attention(q, cache, tables, lens, heads)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    # Prefetching other tensors along the way (a W8A8 layer's next matrices; odd sizes, one empty) changes nothing
    side = [torch.randint(-127, 127, (n,), dtype=torch.int8) for n in (1000, 0, 64 * 37 + 5, 3)]
    assert torch.equal(ops.paged_decode_attention(q, cache, tables, lens, heads, side), got)


def test_silu_and_mul():
    x = torch.randn(3, 10)
    torch.testing.assert_close(ops.silu_and_mul(x), F.silu(x[:, :5]) * x[:, 5:])


# (heads, kv_heads, head_dim, block_size, chunks as (new tokens, cached tokens before them))
PREFILL_SHAPES = [
    (9, 3, 64, 16, [(128, 0), (5, 0), (37, 90), (1, 16), (16, 0)]),
    (4, 4, 16, 4, [(3, 0), (21, 7), (64, 1)]),
    (8, 2, 32, 8, [(200, 0)]),
    (9, 3, 64, 16, [(150, 700), (70, 0)]),  # rows of three tasks over four blocks of keys; one after the other
]


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16, torch.int8])
@pytest.mark.parametrize("heads,kv_heads,hd,block,chunks", PREFILL_SHAPES)
def test_prefill_attention_matches_reference(cache_dtype, heads, kv_heads, hd, block, chunks, torch_threads):
    """Chunks after other chunks and after cached context (chunked prefill, prefix-cache hits), rows and
    contexts that fill no whole tile, against attention.py's SDPA reference; the q rows have a row stride
    wider than the heads (as a view into qkv)."""
    torch.manual_seed(0)
    num_blocks = sum(-(-(n + c) // block) for n, c in chunks) + 2
    cache = random_cache((2, num_blocks, block, kv_heads, hd), cache_dtype)
    free = torch.randperm(num_blocks).tolist()
    prefills, start = [], 0
    for n, cached in chunks:
        need = -(-(n + cached) // block)
        table, free = torch.tensor(free[:need]), free[need:]
        prefills.append(PrefillChunk(start, n, cached, table))
        start += n
    qkv = torch.randn(start, (heads + 2 * kv_heads) * hd)
    q = qkv[:, :heads * hd]
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 0, None, None, None, prefills)
    expected = prefill_attention(q.reshape(start, heads, hd), cache, prefills, 0).reshape(start, -1)
    got = ops.prefill_attention(q, cache, *meta.packed_prefills(), heads)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("total,split", [(70, 33), (600, 263)])
def test_prefill_attention_is_the_same_however_the_prompt_is_chunked(total, split):
    """A row's output depends only on its own keys, in a fixed order: one chunk and the same prompt in two
    (the second after the first's cached tokens) give bit-identical rows, also when the rows' keys span several
    blocks and the rows fall into other tasks."""
    torch.manual_seed(1)
    heads, kv_heads, hd, block = 6, 2, 32, 16
    num_blocks = -(-total // block) + 3
    cache = torch.randn(2, num_blocks, block, kv_heads, hd).to(torch.bfloat16)
    table = torch.randperm(num_blocks)[:-(-total // block)]
    q = torch.randn(total, heads * hd)

    def run(rows: slice, computed: int):
        n = rows.stop - rows.start
        meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), 0, None, None, None,
                                 [PrefillChunk(0, n, computed, table)])
        return ops.prefill_attention(q[rows], cache, *meta.packed_prefills(), heads)

    at_once = run(slice(0, total), 0)
    assert torch.equal(run(slice(0, split), 0), at_once[:split])
    assert torch.equal(run(slice(split, total), split), at_once[split:])
