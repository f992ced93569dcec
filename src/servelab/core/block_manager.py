"""The KV-cache allocator: a fixed pool of fixed-size blocks.

Running out of blocks is a return value (None); misuse (freeing twice, allocating for a
request that has a contiguous reservation) is an exception.

With enable_caching (prefix caching, as vLLM v1's block pool), a request's full blocks whose KV is
computed are entered in a PrefixCache under their hash chain (cache_blocks); a later request starting
with the same tokens is given those blocks (allocate_slots' computed_block_ids) and they are shared,
with a reference per holder. A freed block keeps its cached KV on the free list until allocation hands
it out again: the free list is the LRU eviction queue, and only unreferenced blocks are on it.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import islice

from servelab.core.prefix_cache import PrefixCache


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.prefix_cache = PrefixCache()
        # Leading blocks of each table already entered in (or skipped by) the prefix cache.
        self._num_cached_blocks: dict[str, int] = {}
        # References beyond a block's first, over all blocks: while 0, freeing a table frees every block.
        self._num_shared_refs = 0
        # Free list in allocation order: _free_block_ids[_free_head:] (allocation advances the head, so
        # taking n blocks is one slice). reserve_contiguous and prefix-cache hits take blocks out of its
        # middle; rather than rebuild the list (O(num_blocks) each time) they count them in _num_stale and
        # allocation skips them when they reach the front. Only the last occurrence of a block can
        # be live, so a block's first _num_stale[b] occurrences are the stale ones.
        self._free_block_ids: list[int] = list(range(num_blocks))
        self._free_head = 0
        self._num_stale: dict[int, int] = {}
        self.num_free_blocks = num_blocks  # a plain attribute, not a property: read at every step
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
    def usage(self) -> float:
        return (self.num_blocks - self.num_free_blocks) / self.num_blocks

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
        need = -(-num_tokens // self.block_size) - have
        return need if need > 0 else 0

    def allocate_slots(self, request_id: str, num_tokens: int,
                       computed_block_ids: Sequence[int] = ()) -> list[int] | None:
        """Grow the request's table to hold num_tokens in total; return the new block ids, or None
        (allocating nothing) when the pool has too few free blocks. computed_block_ids (a request without
        a table only): cached blocks (get_computed_blocks) that start its table, shared rather than new."""
        if computed_block_ids:
            return self._allocate_with_computed(request_id, num_tokens, computed_block_ids)
        table = self.block_tables.get(request_id)
        need = -(-num_tokens // self.block_size) - (0 if table is None else len(table))
        if need > 0:
            if request_id in self._contiguous:
                raise RuntimeError(f"request {request_id} outgrew its contiguous reservation")
            if need > self.num_free_blocks:
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
            new = num_tokens if num_tokens > old else old  # max(), without the builtin's slow call in 3.11
            self._num_tokens[request_id] = new
            self._num_tokens_total += new - old
        return new_ids

    def get_computed_blocks(self, block_hashes: Sequence[bytes]) -> list[int]:
        """The cached blocks holding the longest prefix of a request's block hash chain (empty without
        caching). They stay free until allocate_slots takes them, so look up in the same step."""
        return self.prefix_cache.lookup(block_hashes) if self.enable_caching else []

    def num_blocks_to_allocate(self, request_id: str, num_tokens: int, computed_block_ids: Sequence[int] = ()) -> int:
        """Free blocks allocate_slots(request_id, num_tokens, computed_block_ids) would take: the new ones,
        plus the computed ones that are free now (cached, unreferenced)."""
        refs = self._ref_counts
        num_free_hits = sum(1 for block_id in computed_block_ids if block_id not in refs)
        return self.num_new_blocks_needed(request_id, num_tokens) - len(computed_block_ids) + num_free_hits

    def _allocate_with_computed(self, request_id: str, num_tokens: int,
                                computed_block_ids: Sequence[int]) -> list[int] | None:
        if request_id in self.block_tables:
            raise RuntimeError(f"request {request_id} already holds blocks: computed blocks only start a table")
        if num_tokens <= len(computed_block_ids) * self.block_size:
            raise RuntimeError(f"request {request_id} has no token to compute beyond its computed blocks")
        if self.num_blocks_to_allocate(request_id, num_tokens, computed_block_ids) > self.num_free_blocks:
            return None
        for block_id in computed_block_ids:  # before _pop_free, which would evict the free ones
            self._touch(block_id)
        new_ids = self._pop_free(self.num_blocks_for(num_tokens) - len(computed_block_ids))
        table = self.block_tables[request_id] = [*computed_block_ids, *new_ids]
        self._num_table_blocks += len(table)
        self._num_cached_blocks[request_id] = len(computed_block_ids)
        self._num_tokens_total += num_tokens - self._num_tokens.get(request_id, 0)
        self._num_tokens[request_id] = num_tokens
        return new_ids

    def _touch(self, block_id: int) -> None:
        """One more reference to a cached block; a free one leaves the free list where it stands."""
        refs = self._ref_counts.get(block_id)
        if refs is None:
            self._ref_counts[block_id] = 1
            self._num_stale[block_id] = self._num_stale.get(block_id, 0) + 1
            self.num_free_blocks -= 1
            if self._in_use is not None:
                self._in_use[block_id] = 1
        else:
            self._ref_counts[block_id] = refs + 1
            self._num_shared_refs += 1

    def cache_blocks(self, request_id: str, block_hashes: Sequence[bytes], num_full_blocks: int) -> None:
        """Enter the request's first num_full_blocks blocks, whose KV is computed, in the prefix cache;
        block_hashes[i] is block i's hash. Blocks entered before are skipped."""
        start = self._num_cached_blocks.get(request_id, 0)
        if num_full_blocks <= start or not self.enable_caching:
            return
        table, cache = self.block_tables[request_id], self.prefix_cache
        for index in range(start, num_full_blocks):
            cache.insert(block_hashes[index], table[index])
        self._num_cached_blocks[request_id] = num_full_blocks

    def _pop_free(self, count: int) -> list[int]:
        free, head, stale = self._free_block_ids, self._free_head, self._num_stale
        if stale:
            ids: list[int] = []
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
        if count == 1:  # most often (a decode step's block): no dict to build
            self._ref_counts[ids[0]] = 1
        else:
            self._ref_counts.update(dict.fromkeys(ids, 1))  # free blocks have no references
        if self.prefix_cache.cached_hashes:
            self.prefix_cache.evict(ids)
        in_use = self._in_use
        if in_use is not None:
            for block_id in ids:
                in_use[block_id] = 1
        self.num_free_blocks -= count
        return ids

    def append_blocks(self, request_ids: list[str]) -> list[int] | None:
        """Give each listed request (which already holds a paged table) one more block, in list order;
        a request may be listed several times. All or nothing: None when the pool is short. The same
        ids as one allocate_slots call per entry, in that order (multi-step decode uses it)."""
        if len(request_ids) > self.num_free_blocks:
            return None
        new_ids = self._pop_free(len(request_ids))
        tables = self.block_tables
        for request_id, block_id in zip(request_ids, new_ids):
            tables[request_id].append(block_id)
        self._num_table_blocks += len(new_ids)
        return new_ids

    def free_excess_slots(self, request_id: str, num_tokens: int) -> list[int]:
        """Shrink the request's paged table to the blocks num_tokens tokens fill (the slots of rejected
        speculative tokens); returns the blocks it gave back, which go to the back of the free list. Those
        blocks hold no computed token, so none is cached or shared. A contiguous reservation keeps its blocks."""
        old = self._num_tokens.get(request_id, 0)
        if num_tokens < old:
            self._num_tokens[request_id] = num_tokens
            self._num_tokens_total -= old - num_tokens
        table = self.block_tables[request_id]
        keep = -(-num_tokens // self.block_size)
        if keep >= len(table) or request_id in self._contiguous:
            return []
        released = table[keep:]
        del table[keep:]
        refs = self._ref_counts
        for block_id in released:
            if refs.get(block_id) != 1:
                raise RuntimeError(f"block {block_id} of request {request_id} is shared or free: it cannot be rolled back")
            del refs[block_id]
        if self._in_use is not None:
            for block_id in released:
                self._in_use[block_id] = 0
        self._free_block_ids.extend(released)
        self.num_free_blocks += len(released)
        self._num_table_blocks -= len(released)
        return released

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
        if self.prefix_cache:
            self.prefix_cache.evict(ids)
        in_use = self._in_use
        assert in_use is not None  # contiguous reservation keeps the in-use map
        in_use[start:start + need] = b"\x01" * need
        self.num_free_blocks -= need
        self.block_tables[request_id] = ids
        self._num_table_blocks += need
        self._num_tokens_total -= self._num_tokens.get(request_id, 0)
        self._num_tokens[request_id] = 0
        self._contiguous.add(request_id)
        self._compact_free_list()
        return ids

    def _compact_free_list(self) -> None:
        """Drop the stale entries once they outnumber the pool (about once per pool's worth of them)."""
        if len(self._free_block_ids) - self._free_head > 2 * self.num_blocks:
            self._free_block_ids = self._live_free_ids()
            self._free_head = 0
            self._num_stale.clear()

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
        """Note num_tokens more slots holding KV among the members of a decode run (core/decode_runs/planner.py),
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
        """Drop the request's references. Blocks nobody else holds go to the back of the free list, a
        table's last block first: with caching, the free list is the eviction order, and a prefix's
        tail is worth less than its head (a lookup stops at the first missing block)."""
        table = self.block_tables.pop(request_id, None)
        if table is None:
            return
        self._num_tokens_total -= self._num_tokens.pop(request_id, 0)
        self._num_table_blocks -= len(table)
        self._contiguous.discard(request_id)
        refs = self._ref_counts
        if self._num_cached_blocks:
            self._num_cached_blocks.pop(request_id, None)
        if self.enable_caching:
            table = table[::-1]  # a copy: a step's plan may still hold the table
        if self._num_shared_refs:
            released = []
            for block_id in table:
                count = refs.get(block_id)
                if count is None:
                    raise RuntimeError(f"block {block_id} freed twice")
                if count == 1:
                    del refs[block_id]
                    released.append(block_id)
                else:
                    refs[block_id] = count - 1
                    self._num_shared_refs -= 1
        else:
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
        self.num_free_blocks += len(released)
        if self._num_stale:
            self._compact_free_list()

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
        """Every block is free or held; a held block's reference count is the number of tables holding
        it (only cached blocks are in several); the prefix cache's maps agree."""
        owned: dict[int, int] = {}
        for request_id, table in self.block_tables.items():
            if len(set(table)) != len(table):
                raise AssertionError(f"request {request_id} holds a block twice")
            for block_id in table:
                if block_id in owned and self.prefix_cache.block_hash(block_id) is None:
                    raise AssertionError(f"block {block_id} is shared but not cached")
                owned[block_id] = owned.get(block_id, 0) + 1
        free = self._live_free_ids()
        if len(set(free)) != len(free):
            raise AssertionError("a block is on the free list twice")
        if set(free) & set(owned):
            raise AssertionError(f"blocks both free and owned: {sorted(set(free) & set(owned))}")
        if len(free) + len(owned) != self.num_blocks:
            raise AssertionError(f"{self.num_blocks - len(free) - len(owned)} blocks are neither free nor owned")
        if len(free) != self.num_free_blocks:
            raise AssertionError(f"free count {self.num_free_blocks} but {len(free)} blocks on the free list")
        for block_id in range(self.num_blocks):
            expected = owned.get(block_id, 0)
            refs = self._ref_counts.get(block_id, 0)
            if refs != expected or (self._in_use is not None and self._in_use[block_id] != min(expected, 1)):
                raise AssertionError(f"block {block_id} has ref count {refs}, held by {expected} tables")
        if self._num_shared_refs != sum(owned.values()) - len(owned):
            raise AssertionError(f"{self._num_shared_refs} shared references counted, {sum(owned.values()) - len(owned)} held")
        self.prefix_cache.check_invariants()
        if (self._num_table_blocks != sum(owned.values()) or self._num_unattributed_tokens < 0
                or self._num_tokens_total != sum(self._num_tokens.values()) + self._num_unattributed_tokens):
            raise AssertionError("block or token counters out of step with the block tables")


def num_blocks_for_memory(memory_bytes: int, kv_bytes_per_token: int, block_size: int) -> int:
    """How many blocks a KV budget buys (each block holds block_size tokens of every layer's K and V)."""
    return memory_bytes // (kv_bytes_per_token * block_size)
