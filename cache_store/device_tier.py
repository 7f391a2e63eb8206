"""Caches resident on the compute device, one per session. No byte budget yet."""

from __future__ import annotations

from cache_store.entry import CacheEntry


class DeviceTier:
    def __init__(self) -> None:
        self._entries: dict[str, CacheEntry] = {}

    def take(self, session_id: str) -> CacheEntry | None:
        """Remove and return a session's entry: a running turn owns its cache exclusively,
        so no two turns ever share one cache object."""
        return self._entries.pop(session_id, None)

    def put(self, session_id: str, entry: CacheEntry) -> None:
        self._entries[session_id] = entry

    def drop(self, session_id: str) -> bool:
        return self._entries.pop(session_id, None) is not None

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def nbytes(self) -> int:
        return sum(entry.nbytes() for entry in self._entries.values())
