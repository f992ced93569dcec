"""Paged attention over a block-indexed KV cache, and the plain-torch reference it is tested against.

KV cache per layer: (2, num_blocks, block_size, num_kv_heads, head_dim); a token at position p of a
request lives in slot block_table[p // block_size] * block_size + p % block_size. An int8 cache
(--kv-cache-dtype int8) has rows of head_dim + 4 bytes: head_dim int8 values, then their fp32 scale
(quantize_kv), so a block carries its own scales wherever it goes.
The flattened batch puts single-token decodes first, then prefill chunks (see AttentionMetadata).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    start: int  # first row of this chunk in the flattened batch
    num_tokens: int
    num_computed_tokens: int  # cached context before the chunk
    block_table: torch.Tensor  # (num_blocks_of_request,) int64


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # (num_tokens,) int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor | None  # (num_decodes, max_blocks) int64, padded with block 0
    decode_mask: torch.Tensor | None  # (num_decodes, 1, 1, max_blocks * block_size) bool, True = attend
    decode_context_lens: torch.Tensor | None  # (num_decodes,) int64
    prefills: list[PrefillChunk]
    _packed_prefills: tuple | None = None

    def packed_prefills(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The prefill chunks as the CPU kernel takes them, built once per step: row starts (counted from
        the first prefill row), token counts, cached-token counts, and block tables padded to one width."""
        if self._packed_prefills is None:
            chunks = self.prefills
            width = max(len(c.block_table) for c in chunks)
            tables = torch.zeros(len(chunks), width, dtype=torch.int64)
            for row, chunk in zip(tables, chunks):
                row[:len(chunk.block_table)] = chunk.block_table
            offset = self.num_decode_tokens
            self._packed_prefills = (torch.tensor([c.start - offset for c in chunks], dtype=torch.int64),
                                     torch.tensor([c.num_tokens for c in chunks], dtype=torch.int64),
                                     torch.tensor([c.num_computed_tokens for c in chunks], dtype=torch.int64),
                                     tables)
        return self._packed_prefills


INT8_SCALE_BYTES = 4  # an int8 cache row's fp32 scale, after its head_dim values


def quantize_kv(x: torch.Tensor) -> torch.Tensor:
    """(..., head_dim) float -> (..., head_dim + 4) int8 rows: scale = max |x| / 127 in fp32 (stored in the
    last 4 bytes), values round-half-even(x / scale); a row of zeros keeps scale 0. The CPU kernels'
    write_cache (kernels/rowops.h) computes the same bytes."""
    x = x.float()
    scale = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(scale > 0, x / scale, torch.zeros_like(x)).round().clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def dequantize_kv(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """quantize_kv's rows back to values: (..., head_dim + 4) int8 -> (..., head_dim) dtype."""
    scale = rows[..., -INT8_SCALE_BYTES:].contiguous().view(torch.float32)
    return (rows[..., :-INT8_SCALE_BYTES].float() * scale).to(dtype)


def write_kv(kv_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    # k, v: (num_tokens, num_kv_heads, head_dim)
    if kv_cache.dtype == torch.int8:
        k, v = quantize_kv(k), quantize_kv(v)
    num_kv_heads, row = k.shape[1], k.shape[2]
    kv_cache[0].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
    kv_cache[1].view(-1, num_kv_heads, row).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))


def _gather(cache: torch.Tensor, block_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # cache: (num_blocks, block_size, kvh, row); block_ids: (..., n) -> (..., n * block_size, kvh, hd)
    rows = cache[block_ids].flatten(-4, -3)
    return dequantize_kv(rows, dtype) if cache.dtype == torch.int8 else rows.to(dtype)


def paged_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """q: (num_tokens, num_heads, head_dim), KV of this step already written. Returns the same shape."""
    out = torch.empty_like(q)
    num_decode = meta.num_decode_tokens
    if num_decode:
        out[:num_decode] = decode_attention(q[:num_decode], kv_cache, meta)
    if meta.prefills:
        out[num_decode:] = prefill_attention(q[num_decode:], kv_cache, meta.prefills, row_offset=num_decode)
    return out


def decode_attention(q: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    num_decode, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[3]
    # Each KV head serves `group` query heads: treat them as a query length, no KV repeat needed.
    qd = q.view(num_decode, num_kv_heads, num_heads // num_kv_heads, head_dim)
    k = _gather(kv_cache[0], meta.decode_block_tables, q.dtype).transpose(1, 2)  # (B, kvh, L, hd)
    v = _gather(kv_cache[1], meta.decode_block_tables, q.dtype).transpose(1, 2)
    o = F.scaled_dot_product_attention(qd, k, v, attn_mask=meta.decode_mask)
    return o.reshape(num_decode, num_heads, head_dim)


def prefill_attention(q: torch.Tensor, kv_cache: torch.Tensor, chunks: list[PrefillChunk],
                      row_offset: int) -> torch.Tensor:
    """Causal attention of each prefill chunk over its cached context and itself. q holds the
    chunks' rows only; chunk.start counts from row_offset."""
    out = torch.empty_like(q)
    for chunk in chunks:
        rows = slice(chunk.start - row_offset, chunk.start - row_offset + chunk.num_tokens)
        qp = q[rows].transpose(0, 1).unsqueeze(0)  # (1, H, n, hd)
        context = chunk.num_computed_tokens + chunk.num_tokens
        k = _gather(kv_cache[0], chunk.block_table, q.dtype)[:context].transpose(0, 1).unsqueeze(0)
        v = _gather(kv_cache[1], chunk.block_table, q.dtype)[:context].transpose(0, 1).unsqueeze(0)
        if chunk.num_computed_tokens == 0:
            o = F.scaled_dot_product_attention(qp, k, v, is_causal=True, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(
                qp, k, v, attn_mask=causal_mask(chunk.num_tokens, context, q.device), enable_gqa=True)
        out[rows] = o[0].transpose(0, 1)
    return out


def causal_mask(num_queries: int, context_len: int, device: torch.device | None = None) -> torch.Tensor:
    """(num_queries, context_len) bool: query i (at position context_len - num_queries + i) sees keys <= it."""
    offset = context_len - num_queries
    q_pos = torch.arange(num_queries, device=device).unsqueeze(1) + offset
    return torch.arange(context_len, device=device).unsqueeze(0) <= q_pos


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Textbook causal attention for one request, no paging, no fused kernels.

    q: (n, H, hd) for the last n positions; k, v: (context_len, kvh, hd) for all positions.
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    group = num_heads // k.shape[1]
    k = k.repeat_interleave(group, dim=1).transpose(0, 1).float()  # (H, L, hd)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1).float()
    scores = q.transpose(0, 1).float() @ k.transpose(1, 2) / head_dim ** 0.5  # (H, n, L)
    scores = scores.masked_fill(~causal_mask(q.shape[0], k.shape[1], q.device), float("-inf"))
    return (scores.softmax(-1) @ v).transpose(0, 1).to(q.dtype)
