"""Routers in front of a pool of instances: round-robin, least-loaded by outstanding requests, or prefix
(KV-cache-aware: core/prefix_router.py, the real engine's policy)."""
from __future__ import annotations

from typing import Protocol, Sequence

from servelab.core.prefix_router import PrefixRouter


class Loaded(Protocol):
    num_outstanding: int


class LoadBalancer:
    def __init__(self, policy: str, instances: Sequence[Loaded], capacity_blocks: int = 1) -> None:
        if policy not in ("round-robin", "least-loaded", "prefix"):
            raise ValueError(f"unknown router {policy!r}")
        self.policy = policy
        self.instances = list(instances)
        self._next = 0
        self.prefix_router = PrefixRouter(capacity_blocks) if policy == "prefix" else None

    def add(self, instance: Loaded) -> None:
        self.instances.append(instance)

    def remove(self, instance: Loaded) -> None:
        index = self.instances.index(instance)
        del self.instances[index]
        if self.prefix_router is not None:
            self.prefix_router.forget(instance)
        if index < self._next:  # round-robin carries on with the instance that was next
            self._next -= 1
        self._next = self._next % len(self.instances) if self.instances else 0

    @property
    def picks_in_turn(self) -> bool:
        """Whether whom the router picks depends only on the order of picks (round-robin), not on load."""
        return self.policy == "round-robin"

    @property
    def needs_block_hashes(self) -> bool:
        return self.prefix_router is not None

    def picks_before(self, instance: Loaded) -> int:
        """Round-robin: how many picks come before the next one of instance (one of the instances),
        while the instances stay as they are."""
        if not self.picks_in_turn:
            raise ValueError(f"the {self.policy} router picks by load: its turns are not known in advance")
        return (self.instances.index(instance) - self._next) % len(self.instances)

    def pick(self, block_hashes: Sequence[bytes] = ()) -> Loaded:
        """block_hashes: the prompt's full-block hash chain (the prefix router's input)."""
        if self.prefix_router is not None:
            instances = self.instances
            chosen = instances[self.prefix_router.pick(instances, [i.num_outstanding for i in instances],
                                                       block_hashes)]
            self.prefix_router.routed(chosen, block_hashes)
            return chosen
        if self.policy == "least-loaded":
            # ties go to the lowest index, so runs are deterministic
            return min(self.instances, key=lambda inst: inst.num_outstanding)
        instance = self.instances[self._next]
        self._next = (self._next + 1) % len(self.instances)
        return instance
