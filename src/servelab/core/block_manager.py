"""The KV-cache allocator: a fixed pool of fixed-size blocks.

Running out of blocks is a return value (None); misuse (freeing twice, allocating for a
request that has a contiguous reservation) is an exception.
"""
from __future__ import annotations

from collections import deque


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free_block_ids: deque[int] = deque(range(num_blocks))
        self._ref_counts = [0] * num_blocks
        self.block_tables: dict[str, list[int]] = {}
        # Tokens actually written per request, to measure reserved-but-unused slots.
        self._num_tokens: dict[str, int] = {}
        self._contiguous: set[str] = set()

    # ---- queries
    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free_block_ids)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return cdiv(num_tokens, self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def num_reserved_unused_slots(self) -> int:
        """Token slots held by requests but not (yet) filled: the waste of contiguous reservation."""
        held = sum(len(t) for t in self.block_tables.values()) * self.block_size
        return held - sum(self._num_tokens.values())

    # ---- paged allocation (stage 3+)
    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def can_allocate(self, request_id: str, num_tokens: int) -> bool:
        return self.num_new_blocks_needed(request_id, num_tokens) <= self.num_free_blocks

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold num_tokens in total; return the new block ids, or None
        (allocating nothing) when the pool has too few free blocks."""
        if request_id in self._contiguous and num_tokens > len(self.block_tables[request_id]) * self.block_size:
            raise RuntimeError(f"request {request_id} outgrew its contiguous reservation")
        need = self.num_new_blocks_needed(request_id, num_tokens)
        if need > self.num_free_blocks:
            return None
        new_ids = [self._free_block_ids.popleft() for _ in range(need)]
        for block_id in new_ids:
            self._ref_counts[block_id] += 1
        self.block_tables.setdefault(request_id, []).extend(new_ids)
        self._num_tokens[request_id] = max(self._num_tokens.get(request_id, 0), num_tokens)
        return new_ids

    # ---- contiguous reservation (stages 1 and 2)
    def reserve_contiguous(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Reserve one run of consecutive block ids for the request's whole lifetime (first fit),
        or None when no run is long enough (external fragmentation counts)."""
        if request_id in self.block_tables:
            raise RuntimeError(f"request {request_id} already holds blocks")
        need = self.num_blocks_for(num_tokens)
        start = self._find_free_run(need)
        if start is None:
            return None
        ids = list(range(start, start + need))
        taken = set(ids)
        self._free_block_ids = deque(b for b in self._free_block_ids if b not in taken)
        for block_id in ids:
            self._ref_counts[block_id] += 1
        self.block_tables[request_id] = ids
        self._num_tokens[request_id] = 0
        self._contiguous.add(request_id)
        return ids

    def _find_free_run(self, length: int) -> int | None:
        run_start, run_len = 0, 0
        for block_id in range(self.num_blocks):
            if self._ref_counts[block_id] == 0:
                if run_len == 0:
                    run_start = block_id
                run_len += 1
                if run_len == length:
                    return run_start
            else:
                run_len = 0
        return None

    def record_tokens(self, request_id: str, num_tokens: int) -> None:
        """Note how many slots of a contiguous reservation hold KV now."""
        self._num_tokens[request_id] = num_tokens

    # ---- release
    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return
        self._num_tokens.pop(request_id, None)
        self._contiguous.discard(request_id)
        for block_id in table:
            self._ref_counts[block_id] -= 1
            if self._ref_counts[block_id] < 0:
                raise RuntimeError(f"block {block_id} freed twice")
            if self._ref_counts[block_id] == 0:
                self._free_block_ids.append(block_id)

    def check_invariants(self) -> None:
        owned: dict[int, str] = {}
        for request_id, table in self.block_tables.items():
            for block_id in table:
                if block_id in owned:
                    raise AssertionError(f"block {block_id} owned by {owned[block_id]} and {request_id}")
                owned[block_id] = request_id
        free = list(self._free_block_ids)
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        if set(free) & set(owned):
            raise AssertionError(f"blocks both free and owned: {sorted(set(free) & set(owned))}")
        if len(free) + len(owned) != self.num_blocks:
            raise AssertionError(f"{self.num_blocks - len(free) - len(owned)} blocks are neither free nor owned")
        for block_id in range(self.num_blocks):
            expected = 1 if block_id in owned else 0
            if self._ref_counts[block_id] != expected:
                raise AssertionError(f"block {block_id} has ref count {self._ref_counts[block_id]}")


def num_blocks_for_memory(memory_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """How many blocks a KV budget buys (each block holds block_size tokens of every layer's K and V)."""
    return memory_bytes // (kv_bytes_per_token * block_size)
