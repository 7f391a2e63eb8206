"""Caches offloaded to host memory, under a byte budget that counts the memory really held: the pool's
buffers, in use or free, plus any entry that owns its memory (a shared segment once, whatever starts with it).
What no cache needs goes first (a shared segment nothing starts with any more), then the first offloaded (they
were the least recently used on the device when they left it), sessions' caches before shared segments (which
every cache that starts with one needs)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

import torch

from cache_store.host_pool import HostBufferPool, size_class
from cache_store.offload import HostEntry
from cache_store.segments import is_segment


class HostTier:
    """Offloaded caches in host memory, first offloaded dropped first, under the memory really held."""

    def __init__(self, budget_bytes: int, pool: HostBufferPool | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.budget_bytes = budget_bytes
        self.pool = pool or HostBufferPool(pinned=False)
        self._clock = clock
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()  # first offloaded first
        self._put_at: dict[str, float] = {}

    def make_room(self, nbytes: int, needed: Callable[[str], bool] = lambda key: True) -> tuple[list[str], bool]:
        """Drop entries (and release free buffers) until a buffer for `nbytes` fits under the budget: shared
        segments not `needed` first (no cache here starts with them), then the oldest sessions' caches, then the
        oldest segments; return the keys dropped and whether it fits now."""
        if size_class(nbytes) > self.budget_bytes:
            return [], False
        need = 0 if self.pool.reusable(nbytes) else size_class(nbytes)
        dropped = []
        while self.used_bytes() + need > self.budget_bytes:
            in_use = self.used_bytes() - self.pool.free_bytes
            if self.pool.release_free(keep_bytes=max(0, self.budget_bytes - need - in_use)):
                continue
            if not self._entries:  # the rest is still being copied back to the device
                return dropped, False
            # Then sessions' caches: dropping a shared segment would lose every cache that starts with it.
            oldest = next((key for key in self._entries if is_segment(key) and not needed(key)), None) or \
                next((key for key in self._entries if not is_segment(key)), next(iter(self._entries)))
            entry = self._entries.pop(oldest)
            self._put_at.pop(oldest)
            self.release(entry)
            dropped.append(oldest)
        return dropped, True

    def put(self, key: str, entry: HostEntry, first_to_go: bool = False) -> None:
        """Keep `entry`, whose buffer came from `pool` after `make_room` (a copy it continues stays);
        `first_to_go`: dropped before every other entry (a copy of a cache that is also on the device)."""
        if (previous := self.pop(key)) is not None and previous is not entry.base and previous is not entry:
            self.release(previous)
        self._entries[key] = entry
        self._entries.move_to_end(key, last=not first_to_go)
        self._put_at[key] = self._clock()

    def release(self, entry: HostEntry, copied: torch.cuda.Event | None = None) -> None:
        """An entry taken out with `pop` is no longer needed: its buffers (the copies it continues included) are
        free for reuse once the copy that `copied` (or a restore still reading them) marks has completed."""
        for piece in entry.pieces():
            if piece.buffer is not None:
                self.pool.give(piece.buffer, copied or piece.restoring)
                piece.buffer = None

    def release_after(self, entry: HostEntry, keep: HostEntry) -> None:
        """Release the copies of `entry`'s chain that come after `keep` (which stays in use)."""
        kept = {id(piece) for piece in keep.pieces()}
        for piece in entry.pieces():
            if id(piece) not in kept and piece.buffer is not None:
                self.pool.give(piece.buffer, piece.restoring)
                piece.buffer = None

    def get(self, key: str) -> HostEntry | None:
        return self._entries.get(key)

    def touch(self, key: str) -> None:
        """Count `key` as offloaded now (a segment's copy that a restore used and kept)."""
        self._entries.move_to_end(key)
        self._put_at[key] = self._clock()

    def pop(self, key: str) -> HostEntry | None:
        """Take an entry out; the caller hands it to `release` when done with it."""
        self._put_at.pop(key, None)
        return self._entries.pop(key, None)

    def discard(self, key: str) -> None:
        if (entry := self.pop(key)) is not None:
            self.release(entry)

    def put_at(self, key: str) -> float:
        return self._put_at[key]

    def used_bytes(self) -> int:
        return self.pool.held_bytes + sum(piece.nbytes for entry in self._entries.values()
                                          for piece in entry.pieces() if piece.buffer is None)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)
