"""Eviction policies: a priority per resident cache; the lowest priority is evicted first.

Keeping the policy a single function lets a deployment swap it without touching the tiers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass
class Residency:
    """What a policy may look at to rank a cache."""

    key: str
    last_access: float
    connected: bool = False
    running: bool = False


class EvictionPolicy(Protocol):
    """The order in which idle caches leave the device."""

    def priority(self, residency: Residency) -> tuple: ...


class LRUPolicy:
    """Least recently used first."""

    def priority(self, residency: Residency) -> tuple:
        return (residency.last_access,)


class ConnectedLRUPolicy:
    """Sessions whose client has left go before connected ones; least recently used first within each."""

    def priority(self, residency: Residency) -> tuple:
        return (residency.connected, residency.last_access)
