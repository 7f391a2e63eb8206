"""Eviction policies: a priority per resident cache; the lowest priority is evicted first.

Keeping the policy a single function lets a deployment swap it without touching the tiers.
"""

from __future__ import annotations

from collections.abc import Callable
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
    """Caches kept resident (a cache breakpoint's ttl, `kept`) go after all others; then sessions whose client has
    left before connected ones; least recently used first within each."""

    def __init__(self, kept: Callable[[str], bool] = lambda key: False):
        self.kept = kept

    def priority(self, residency: Residency) -> tuple:
        return (self.kept(residency.key), residency.connected, residency.last_access)
