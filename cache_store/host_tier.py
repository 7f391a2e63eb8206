"""Caches offloaded to host memory, under a byte budget; the least recently used are dropped."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from cache_store.offload import HostEntry


class HostTier:
    def __init__(self, budget_bytes: int, clock: Callable[[], float] = time.monotonic):
        self.budget_bytes = budget_bytes
        self._clock = clock
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()  # least recently put first
        self._put_at: dict[str, float] = {}

    def put(self, key: str, entry: HostEntry) -> list[str]:
        """Keep `entry`; return the keys dropped to make room (`key` itself if it can never fit)."""
        if entry.nbytes > self.budget_bytes:
            return [key]
        dropped = []
        while self.used_bytes() + entry.nbytes > self.budget_bytes:
            oldest, _ = self._entries.popitem(last=False)
            self._put_at.pop(oldest)
            dropped.append(oldest)
        self._entries[key] = entry
        self._put_at[key] = self._clock()
        return dropped

    def get(self, key: str) -> HostEntry | None:
        return self._entries.get(key)

    def pop(self, key: str) -> HostEntry | None:
        self._put_at.pop(key, None)
        return self._entries.pop(key, None)

    def nbytes(self, key: str) -> int:
        return self._entries[key].nbytes

    def put_at(self, key: str) -> float:
        return self._put_at[key]

    def used_bytes(self) -> int:
        return sum(entry.nbytes for entry in self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)
