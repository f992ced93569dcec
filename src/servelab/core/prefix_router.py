"""KV-cache-aware routing: send a request where its prompt's leading blocks are most likely cached, unless that
replica is loaded enough that waiting there costs more than computing the prefix elsewhere.

The router keeps, per replica, the block hashes (core/block_hash.py: the same chain in every process) of the
prompts it sent there, in least-recently-routed order and no more than the replica's KV pool holds: the
approximate prefix index of SGLang's cache-aware router and llm-d's approximate prefix-cache scorer. Each
replica's cost is Dynamo's KV router's shape, blocks to prefill plus a load term:

    cost = (prompt blocks - leading blocks cached there) + load_weight x outstanding requests

and the cheapest replica wins (ties: fewer outstanding, then the lowest index). load_weight is how many
prefill blocks one queued request is worth; by default the mean number of blocks the requests routed so far
had to prefill (their prompt blocks not cached where they went, at least 1), so one queued request weighs
about the prefill it brings. Shared by the real engine's
data-parallel and P/D routing (engine/async_llm.py) and the lab's load balancer (lab/sim/load_balancer.py).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Sequence


class PrefixRouter:
    def __init__(self, capacity_blocks: int, load_weight: float | None = None) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"capacity_blocks must be >= 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.load_weight = load_weight
        self._cached: dict[Hashable, OrderedDict[bytes, None]] = {}
        self._num_routed = 0
        self._num_blocks_routed = 0

    def num_cached_blocks(self, replica: Hashable, block_hashes: Sequence[bytes]) -> int:
        """How many leading blocks of block_hashes the router sent to replica (and it likely still holds)."""
        cached = self._cached.get(replica)
        if not cached:
            return 0
        n = 0
        for h in block_hashes:
            if h not in cached:
                break
            n += 1
        return n

    def weight(self) -> float:
        if self.load_weight is not None:
            return self.load_weight
        return max(1.0, self._num_blocks_routed / self._num_routed) if self._num_routed else 1.0

    def pick(self, replicas: Sequence[Hashable], loads: Sequence[int], block_hashes: Sequence[bytes]) -> int:
        """The position in replicas (with their outstanding requests, loads) of the cheapest one."""
        if not replicas:
            raise ValueError("no replica to route to")
        w, total = self.weight(), len(block_hashes)
        costs = [(total - self.num_cached_blocks(r, block_hashes) + w * load, load, i)
                 for i, (r, load) in enumerate(zip(replicas, loads))]
        return min(costs)[2]

    def routed(self, replica: Hashable, block_hashes: Sequence[bytes]) -> None:
        """Record that replica computes (and caches) these blocks."""
        self._num_routed += 1
        self._num_blocks_routed += len(block_hashes) - self.num_cached_blocks(replica, block_hashes)
        cached = self._cached.setdefault(replica, OrderedDict())
        for h in reversed(block_hashes):  # a prompt's first blocks are the last to go, as in vLLM's free order
            cached[h] = None
            cached.move_to_end(h)
        while len(cached) > self.capacity_blocks:
            cached.popitem(last=False)

    def forget(self, replica: Hashable) -> None:
        """The replica left (scaled down, or died): its cache goes with it."""
        self._cached.pop(replica, None)
