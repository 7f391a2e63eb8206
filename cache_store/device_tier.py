"""Caches resident on the compute device, under a byte budget."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from cache_store.entry import CacheEntry
from cache_store.policy import ConnectedLRUPolicy, EvictionPolicy, Residency


class DeviceTier:
    def __init__(self, budget_bytes: int, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.budget_bytes = budget_bytes
        self.policy = policy or ConnectedLRUPolicy()
        self._clock = clock
        self._entries: dict[str, CacheEntry] = {}
        self._residency: dict[str, Residency] = {}

    def get(self, key: str) -> CacheEntry | None:
        if (entry := self._entries.get(key)) is not None:
            self._residency[key].last_access = self._clock()
        return entry

    def put(self, key: str, entry: CacheEntry, connected: bool = False) -> None:
        """Make `entry` resident. The caller makes room first (see `victims`)."""
        self._entries[key] = entry
        residency = self._residency.setdefault(key, Residency(key, self._clock()))
        residency.last_access, residency.connected = self._clock(), connected

    def pop(self, key: str) -> CacheEntry | None:
        self._residency.pop(key, None)
        return self._entries.pop(key, None)

    def residency(self, key: str) -> Residency | None:
        return self._residency.get(key)

    def victims(self, need_bytes: int, keep: str | None = None) -> list[str]:
        """Keys to evict, in eviction order, so that `need_bytes` more fit under the budget.
        Running caches and `keep` are never chosen; if they alone overflow, fewer are returned."""
        candidates = sorted(self._evictable(keep), key=self.policy.priority)
        over = self.used_bytes() + need_bytes - self.budget_bytes
        chosen = []
        for residency in candidates:
            if over <= 0:
                break
            chosen.append(residency.key)
            over -= self._entries[residency.key].nbytes()
        return chosen

    def can_fit(self, need_bytes: int) -> bool:
        """Whether evicting everything that may be evicted would leave room for `need_bytes`."""
        pinned = sum(self._entries[r.key].nbytes() for r in self._residency.values() if r.running)
        return pinned + need_bytes <= self.budget_bytes

    def _evictable(self, keep: str | None) -> list[Residency]:
        return [r for r in self._residency.values() if not r.running and r.key != keep]

    def used_bytes(self) -> int:
        return sum(entry.nbytes() for entry in self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))
