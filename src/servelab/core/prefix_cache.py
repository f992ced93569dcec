"""The prefix cache's map between full-block hashes (core/block_hash.py) and the KV blocks holding them.

The BlockManager owns the blocks (their reference counts and the free list); this map only says which of
them, owned or free, hold the KV of which hash chain. A cached block stays in the map while it is free
and leaves it when the free list hands it out again (eviction), so the free list's order is the eviction
order: least recently freed first. One block per hash: when two requests computed the same block at the
same time, the second copy is never entered and goes back to the pool as an ordinary block.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence


class PrefixCache:
    def __init__(self) -> None:
        self._block_ids: dict[bytes, int] = {}
        self.cached_hashes: dict[int, bytes] = {}  # block id -> hash; read-only outside (a cheap emptiness test)

    def __len__(self) -> int:
        return len(self.cached_hashes)

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._block_ids

    def block_hash(self, block_id: int) -> bytes | None:
        return self.cached_hashes.get(block_id)

    def lookup(self, block_hashes: Iterable[bytes]) -> list[int]:
        """The blocks of the longest cached prefix of the hash chain block_hashes, in order."""
        found, cached = [], self._block_ids
        for block_hash in block_hashes:
            block_id = cached.get(block_hash)
            if block_id is None:
                break
            found.append(block_id)
        return found

    def insert(self, block_hash: bytes, block_id: int) -> None:
        """Enter a block whose KV is computed. A hash already cached keeps its block."""
        if block_hash not in self._block_ids:
            if block_id in self.cached_hashes:
                raise RuntimeError(f"block {block_id} is cached already")
            self._block_ids[block_hash] = block_id
            self.cached_hashes[block_id] = block_hash

    def evict(self, block_ids: Sequence[int]) -> None:
        """Forget the blocks about to be overwritten (those not cached are skipped)."""
        hashes = self.cached_hashes
        for block_id in block_ids:
            block_hash = hashes.pop(block_id, None)
            if block_hash is not None:
                del self._block_ids[block_hash]

    def check_invariants(self) -> None:
        if len(self._block_ids) != len(self.cached_hashes) or any(
                self.cached_hashes.get(block_id) != block_hash for block_hash, block_id in self._block_ids.items()):
            raise AssertionError("prefix cache: hash -> block and block -> hash maps disagree")
