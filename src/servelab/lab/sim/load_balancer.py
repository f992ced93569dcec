"""Routers in front of a pool of instances: round-robin, or least-loaded by outstanding requests."""
from __future__ import annotations

from typing import Protocol, Sequence


class Loaded(Protocol):
    num_outstanding: int


class LoadBalancer:
    def __init__(self, policy: str, instances: Sequence[Loaded]) -> None:
        if policy not in ("round-robin", "least-loaded"):
            raise ValueError(f"unknown router {policy!r}")
        self.policy = policy
        self.instances = list(instances)
        self._next = 0

    def add(self, instance: Loaded) -> None:
        self.instances.append(instance)

    def remove(self, instance: Loaded) -> None:
        index = self.instances.index(instance)
        del self.instances[index]
        if index < self._next:  # round-robin carries on with the instance that was next
            self._next -= 1
        self._next = self._next % len(self.instances) if self.instances else 0

    @property
    def picks_in_turn(self) -> bool:
        """Whether whom the router picks depends only on the order of picks (round-robin), not on load."""
        return self.policy == "round-robin"

    def picks_before(self, instance: Loaded) -> int:
        """Round-robin: how many picks come before the next one of instance (one of the instances),
        while the instances stay as they are."""
        if not self.picks_in_turn:
            raise ValueError(f"the {self.policy} router picks by load: its turns are not known in advance")
        return (self.instances.index(instance) - self._next) % len(self.instances)

    def pick(self) -> Loaded:
        if self.policy == "least-loaded":
            # ties go to the lowest index, so runs are deterministic
            return min(self.instances, key=lambda inst: inst.num_outstanding)
        instance = self.instances[self._next]
        self._next = (self._next + 1) % len(self.instances)
        return instance
