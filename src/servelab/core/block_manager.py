"""The KV-cache allocator: a fixed pool of fixed-size blocks.

Running out of blocks is a return value (None); misuse (freeing twice, allocating for a
request that has a contiguous reservation) is an exception.
"""
from __future__ import annotations

from itertools import islice


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Free list in allocation order: _free_block_ids[_free_head:] (allocation advances the head, so
        # taking n blocks is one slice). reserve_contiguous takes blocks out of its middle; rather
        # than rebuild the list (O(num_blocks) per reservation) it counts them in _num_stale and
        # allocation skips them when they reach the front. Only the last occurrence of a block can
        # be live, so a block's first _num_stale[b] occurrences are the stale ones.
        self._free_block_ids: list[int] = list(range(num_blocks))
        self._free_head = 0
        self._num_stale: dict[int, int] = {}
        self._num_free = num_blocks
        # References to each owned block (a free block has no entry), so freeing a table and taking
        # blocks off the free list are dict operations in C rather than Python loops.
        self._ref_counts: dict[int, int] = {}
        # 1 where a block is owned: first-fit search for a free run is a bytes.find. Kept only once a
        # contiguous reservation has needed it; paged allocation never does.
        self._in_use: bytearray | None = None
        self.block_tables: dict[str, list[int]] = {}
        # Tokens actually written per request, to measure reserved-but-unused slots.
        self._num_tokens: dict[str, int] = {}
        self._num_tokens_total = 0
        self._num_unattributed_tokens = 0  # in the total, not yet in _num_tokens (see record_decode_tokens)
        self._num_table_blocks = 0
        self._contiguous: set[str] = set()

    # ---- queries
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def usage(self) -> float:
        return (self.num_blocks - self._num_free) / self.num_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def get_block_table(self, request_id: str) -> list[int]:
        return self.block_tables[request_id]

    def num_reserved_unused_slots(self) -> int:
        """Token slots held by requests but not (yet) filled: the waste of contiguous reservation."""
        return self._num_table_blocks * self.block_size - self._num_tokens_total

    # ---- paged allocation (stage 3+)
    def num_new_blocks_needed(self, request_id: str, num_tokens: int) -> int:
        have = len(self.block_tables.get(request_id, ()))
        return max(0, self.num_blocks_for(num_tokens) - have)

    def allocate_slots(self, request_id: str, num_tokens: int) -> list[int] | None:
        """Grow the request's table to hold num_tokens in total; return the new block ids, or None
        (allocating nothing) when the pool has too few free blocks."""
        table = self.block_tables.get(request_id)
        need = -(-num_tokens // self.block_size) - (0 if table is None else len(table))
        if need > 0:
            if request_id in self._contiguous:
                raise RuntimeError(f"request {request_id} outgrew its contiguous reservation")
            if need > self._num_free:
                return None
            new_ids = self._pop_free(need)
            if table is None:
                self.block_tables[request_id] = list(new_ids)
            else:
                table.extend(new_ids)
            self._num_table_blocks += need
        else:
            new_ids = []
            if table is None:
                self.block_tables[request_id] = []
        old = self._num_tokens.get(request_id, 0)
        if num_tokens > old or request_id not in self._num_tokens:
            self._num_tokens[request_id] = max(old, num_tokens)
            self._num_tokens_total += max(old, num_tokens) - old
        return new_ids

    def _pop_free(self, count: int) -> list[int]:
        free, head, stale = self._free_block_ids, self._free_head, self._num_stale
        if stale:
            ids = []
            while len(ids) < count:
                block_id = free[head]
                head += 1
                left = stale.get(block_id)
                if left:
                    if left == 1:
                        del stale[block_id]
                    else:
                        stale[block_id] = left - 1
                    continue
                ids.append(block_id)
        else:
            ids = free[head:head + count]
            head += count
        if head >= self.num_blocks:  # drop the used prefix, about once per pool's worth of allocations
            del free[:head]
            head = 0
        self._free_head = head
        self._ref_counts.update(dict.fromkeys(ids, 1))  # free blocks have no references
        in_use = self._in_use
        if in_use is not None:
            for block_id in ids:
                in_use[block_id] = 1
        self._num_free -= count
        return ids

    def append_blocks(self, request_ids: list[str]) -> list[int] | None:
        """Give each listed request (which already holds a paged table) one more block, in list order;
        a request may be listed several times. All or nothing: None when the pool is short. The same
        ids as one allocate_slots call per entry, in that order (multi-step decode uses it)."""
        if len(request_ids) > self._num_free:
            return None
        new_ids = self._pop_free(len(request_ids))
        tables = self.block_tables
        for request_id, block_id in zip(request_ids, new_ids):
            tables[request_id].append(block_id)
        self._num_table_blocks += len(new_ids)
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
        stale = self._num_stale
        for block_id in ids:
            stale[block_id] = stale.get(block_id, 0) + 1
        self._ref_counts.update(dict.fromkeys(ids, 1))  # free blocks have no references
        self._in_use[start:start + need] = b"\x01" * need
        self._num_free -= need
        self.block_tables[request_id] = ids
        self._num_table_blocks += need
        self._num_tokens_total -= self._num_tokens.get(request_id, 0)
        self._num_tokens[request_id] = 0
        self._contiguous.add(request_id)
        if len(self._free_block_ids) - self._free_head > 2 * self.num_blocks:
            self._free_block_ids = self._live_free_ids()
            self._free_head = 0
            stale.clear()
        return ids

    def _find_free_run(self, length: int) -> int | None:
        if length < 1:
            return None
        if self._in_use is None:
            self._in_use = bytearray(self.num_blocks)
            for block_id in self._ref_counts:
                self._in_use[block_id] = 1
        start = self._in_use.find(bytes(length))
        return None if start < 0 else start

    def record_tokens(self, request_id: str, num_tokens: int) -> None:
        """Note how many slots of a contiguous reservation hold KV now."""
        self._num_tokens_total += num_tokens - self._num_tokens.get(request_id, 0)
        self._num_tokens[request_id] = num_tokens

    def record_decode_tokens(self, num_tokens: int) -> None:
        """Note num_tokens more slots holding KV among the members of a decode run (core/decode_runs.py),
        counted at once and attributed to requests later by attribute_tokens: a run's batch can be
        hundreds of requests, and the count stays exact after every run at no cost per member."""
        self._num_tokens_total += num_tokens
        self._num_unattributed_tokens += num_tokens

    def attribute_tokens(self, request_id: str, num_tokens: int) -> None:
        """record_tokens for a request whose new tokens record_decode_tokens has counted; before the
        request's table changes or is freed."""
        counts = self._num_tokens
        self._num_unattributed_tokens -= num_tokens - counts[request_id]
        counts[request_id] = num_tokens

    # ---- release
    def free(self, request_id: str) -> None:
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return
        self._num_tokens_total -= self._num_tokens.pop(request_id, 0)
        self._num_table_blocks -= len(table)
        self._contiguous.discard(request_id)
        refs = self._ref_counts
        try:
            for block_id in table:  # one holder per block: every block goes back
                del refs[block_id]
        except KeyError as unowned:
            raise RuntimeError(f"block {unowned.args[0]} freed twice") from None
        released = table
        if self._in_use is not None:
            for block_id in released:
                self._in_use[block_id] = 0
        self._free_block_ids.extend(released)
        self._num_free += len(released)

    def _live_free_ids(self) -> list[int]:
        """The free list in allocation order, stale entries skipped."""
        skip = dict(self._num_stale)
        live = []
        for block_id in islice(self._free_block_ids, self._free_head, None):
            if skip.get(block_id):
                skip[block_id] -= 1
            else:
                live.append(block_id)
        return live

    def check_invariants(self) -> None:
        owned: dict[int, str] = {}
        for request_id, table in self.block_tables.items():
            for block_id in table:
                if block_id in owned:
                    raise AssertionError(f"block {block_id} owned by {owned[block_id]} and {request_id}")
                owned[block_id] = request_id
        free = self._live_free_ids()
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        if set(free) & set(owned):
            raise AssertionError(f"blocks both free and owned: {sorted(set(free) & set(owned))}")
        if len(free) + len(owned) != self.num_blocks:
            raise AssertionError(f"{self.num_blocks - len(free) - len(owned)} blocks are neither free nor owned")
        if len(free) != self._num_free:
            raise AssertionError(f"free count {self._num_free} but {len(free)} blocks on the free list")
        for block_id in range(self.num_blocks):
            expected = 1 if block_id in owned else 0
            refs = self._ref_counts.get(block_id, 0)
            if refs != expected or (self._in_use is not None and self._in_use[block_id] != expected):
                raise AssertionError(f"block {block_id} has ref count {refs}")
        if (self._num_table_blocks != len(owned) or self._num_unattributed_tokens < 0
                or self._num_tokens_total != sum(self._num_tokens.values()) + self._num_unattributed_tokens):
            raise AssertionError("block or token counters out of step with the block tables")


def num_blocks_for_memory(memory_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """How many blocks a KV budget buys (each block holds block_size tokens of every layer's K and V)."""
    return memory_bytes // (kv_bytes_per_token * block_size)
