"""A KV block's identity in the prefix cache: a hash chain over full blocks of token ids (vLLM's kv_cache_utils).

Block i's hash is sha256(block i-1's hash + block i's token ids), so two equal hashes mean two equal whole
prefixes, not just two equal blocks. sha256 rather than Python's hash(): the same prompt must hash alike in
every process (data-parallel engine cores, a restarted server), and Python salts str and bytes hashes per
process. Only full blocks are hashed; a partly filled block is never shared.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from servelab.core.block_manager import BlockManager
from servelab.core.request import Request

# The parent of a request's first block.
ROOT_BLOCK_HASH = hashlib.sha256(b"servelab prefix cache v1").digest()


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def hash_token_blocks(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The hash chain of token_ids' full blocks."""
    hashes, parent = [], ROOT_BLOCK_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start:start + block_size])
        hashes.append(parent)
    return hashes


def request_block_hashes(request: Request, block_size: int, num_blocks: int) -> list[bytes]:
    """request.block_hashes holding (at least) its first num_blocks full blocks' hashes, hashing only the
    blocks not hashed before: a request's tokens only ever grow, so a full block's hash never changes."""
    hashes = request.block_hashes
    if len(hashes) < num_blocks:
        parent = hashes[-1] if hashes else ROOT_BLOCK_HASH
        for index in range(len(hashes), num_blocks):
            parent = hash_block_tokens(parent, request.token_ids_slice(index * block_size, (index + 1) * block_size))
            hashes.append(parent)
    return hashes


def cache_computed_blocks(block_manager: BlockManager, request: Request) -> None:
    """Enter the request's full blocks whose KV is computed in the block manager's prefix cache (when
    caching is on and the request takes part); those entered before are skipped."""
    if block_manager.enable_caching and request.cache_prefix:
        block_size = block_manager.block_size
        num_full = request.num_computed_tokens // block_size
        block_manager.cache_blocks(request.request_id, request_block_hashes(request, block_size, num_full), num_full)
