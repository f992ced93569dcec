"""Paged attention (decode batch and chunked prefill over cached context) against the textbook reference."""
import pytest
import torch

from servelab.model.attention import (AttentionMetadata, PrefillChunk, dequantize_kv, paged_attention, quantize_kv,
                                      reference_attention, write_kv)

BLOCK = 4
KVH, H, HD = 2, 6, 8


def scatter_request(cache, k, v, table):
    pos = torch.arange(k.shape[0])
    slots = torch.tensor(table)[pos // BLOCK] * BLOCK + pos % BLOCK
    write_kv(cache, k, v, slots)


@pytest.mark.parametrize("dtype,cache_dtype,tol", [(torch.float32, torch.float32, 1e-5),
                                                   (torch.bfloat16, torch.bfloat16, 2e-2),
                                                   (torch.float32, torch.int8, 1e-5)])
def test_decode_batch_and_prefill_chunks_match_reference(dtype, cache_dtype, tol):
    """An int8 cache against the reference over the values it stores (quantize_kv, then dequantize_kv)."""
    torch.manual_seed(0)
    row = HD + (4 if cache_dtype == torch.int8 else 0)
    cache = torch.zeros(2, 32, BLOCK, KVH, row, dtype=cache_dtype)
    lengths = [5, 12, 1, 9]  # context lengths; requests 0-1 decode, 2-3 prefill (3 with cached context)
    tables = [[7, 3], [0, 9, 4], [30], [12, 5, 21]]
    ks = [torch.randn(n, KVH, HD, dtype=dtype) for n in lengths]
    vs = [torch.randn(n, KVH, HD, dtype=dtype) for n in lengths]
    for k, v, t in zip(ks, vs, tables):
        scatter_request(cache, k, v, t)
    # queries: one per decode, a 1-token prefill, and a 4-token chunk after 5 cached tokens
    new_counts = [1, 1, 1, 4]
    qs = [torch.randn(c, H, HD, dtype=dtype) for c in new_counts]
    q = torch.cat(qs)
    max_blocks = 3
    dec_tables = torch.tensor([tables[0] + [0], tables[1]])
    mask = (torch.arange(max_blocks * BLOCK)[None] < torch.tensor([5, 12])[:, None])[:, None, None, :]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(0, dtype=torch.long), num_decode_tokens=2,
        decode_block_tables=dec_tables, decode_mask=mask, decode_context_lens=torch.tensor([5, 12]),
        prefills=[PrefillChunk(2, 1, 0, torch.tensor(tables[2])), PrefillChunk(3, 4, 5, torch.tensor(tables[3]))])
    out = paged_attention(q, cache, meta)
    row = 0
    if cache_dtype == torch.int8:
        ks = [dequantize_kv(quantize_kv(k), dtype) for k in ks]
        vs = [dequantize_kv(quantize_kv(v), dtype) for v in vs]
    for qi, k, v in zip(qs, ks, vs):
        expected = reference_attention(qi, k, v)
        torch.testing.assert_close(out[row:row + len(qi)].float(), expected.float(), atol=tol, rtol=tol)
        row += len(qi)


def test_reference_is_causal():
    torch.manual_seed(1)
    q, k, v = torch.randn(3, 2, 4), torch.randn(3, 1, 4), torch.randn(3, 1, 4)
    first = reference_attention(q[:1], k[:1], v[:1])
    # the first query attends only to the first key: output equals its value
    torch.testing.assert_close(first[0, 0], v[0, 0])
    full = reference_attention(q, k, v)
    torch.testing.assert_close(full[2:], reference_attention(q[2:], k, v))


def test_quantize_kv_rows():
    """An int8 row: head_dim values round(x / scale), then scale = max |x| / 127 as 4 fp32 bytes; back within
    half a step; a row of zeros stays zeros with scale 0."""
    torch.manual_seed(2)
    x = torch.randn(5, KVH, HD) * torch.tensor([1e-3, 1.0, 30.0, 1.0, 1.0])[:, None, None]
    x[3, 1] = 0
    rows = quantize_kv(x)
    assert rows.dtype == torch.int8 and rows.shape == (5, KVH, HD + 4)
    scale = rows[..., HD:].contiguous().view(torch.float32)
    assert torch.equal(scale, x.abs().amax(-1, keepdim=True) / 127)
    assert torch.equal(rows[..., :HD].abs().amax(-1)[scale[..., 0] > 0], torch.full((9,), 127, dtype=torch.int8))
    back = dequantize_kv(rows, torch.float32)
    assert ((back - x).abs() <= scale / 2 * (1 + 1e-6)).all()
    assert torch.equal(rows[3, 1], torch.zeros(HD + 4, dtype=torch.int8))
