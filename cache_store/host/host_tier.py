"""Caches offloaded to host memory, under a byte budget that counts the memory really held: the pool's
buffers, in use or free, plus any entry that owns its memory (a shared segment once, whatever starts with it).
What no cache needs goes first (a shared segment nothing starts with any more), then the first offloaded (they
were the least recently used on the device when they left it), sessions' caches before shared segments (which
every cache that starts with one needs)."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from cache_store.device.segments import is_segment
from cache_store.host.host_pool import HostBufferPool, size_class
from cache_store.host.offload import HostEntry
from cache_store.tier_events import NO_EVENTS, TierEvents


class HostTier:
    """Offloaded caches in host memory, first offloaded dropped first, under the memory really held. One ownership
    rule for every copy: each holder of a stack (the tier, for each key it keeps; a caller reading a stack or
    building on it) counts once on every copy in it (`refs`: `acquire`, `take`, `put`), and lets it go with
    `release`, which frees a copy nothing holds. A copy named for the chunks it ends stays, named, for later
    offloads to continue after the last stack that included it has gone (then it is the first to go)."""

    def __init__(self, budget_bytes: int, pool: HostBufferPool | None = None,
                 clock: Callable[[], float] = time.monotonic, kept: Callable[[str], bool] = lambda key: False):
        self.budget_bytes = budget_bytes
        self.kept = kept  # sessions kept resident for a cache breakpoint: their copies are dropped last
        self.pool = pool or HostBufferPool(pinned=False)
        self._clock = clock
        self._entries: OrderedDict[str, HostEntry] = OrderedDict()  # first offloaded first
        self._put_at: dict[str, float] = {}
        self._named: OrderedDict[str, HostEntry] = OrderedDict()  # chunk name -> the copy ending there, last used last
        self.events: TierEvents = NO_EVENTS  # told what the tier holds (KV events), as it changes

    def make_room(self, nbytes: int, needed: Callable[[str], bool] = lambda key: True) -> tuple[list[str], bool]:
        """Drop entries (and release free buffers) until a buffer for `nbytes` fits under the budget: named copies
        no stack includes first (the longest first: a shorter one is the base of a longer), then shared segments
        not `needed` (no cache here starts with them), then the oldest sessions' caches, then the oldest
        segments; return the keys dropped (sessions' and segments') and whether it fits now."""
        if size_class(nbytes) > self.budget_bytes:
            return [], False
        need = 0 if self.pool.reusable(nbytes) else size_class(nbytes)
        dropped = []
        while self.used_bytes() + need > self.budget_bytes:
            in_use = self.used_bytes() - self.pool.free_bytes
            if self.pool.release_free(keep_bytes=max(0, self.budget_bytes - need - in_use)):
                continue
            if unused := [piece for piece in self._named.values() if piece.refs == 0]:
                self.forget(max(unused, key=lambda piece: len(piece.token_ids)))
                continue
            if not self._entries:  # the rest is still being copied back to the device
                return dropped, False
            # Then sessions' caches: dropping a shared segment would lose every cache that starts with it.
            # (a session's copy kept resident for a cache breakpoint goes after every other session's)
            oldest = next((key for key in self._entries if is_segment(key) and not needed(key)), None) or \
                next((key for key in self._entries if not is_segment(key) and not self.kept(key)), None) or \
                next((key for key in self._entries if not is_segment(key)), next(iter(self._entries)))
            self.discard(oldest)
            dropped.append(oldest)
        return dropped, True

    def put(self, key: str, entry: HostEntry, first_to_go: bool = False) -> None:
        """Keep `entry`, whose buffers came from `pool` after `make_room`, as `key`'s stack (the tier's own
        reference: a caller that holds one still releases it), naming its named copies for later offloads to
        continue; `first_to_go`: dropped before every other entry (a copy of a cache that is also on the device).
        The stack it replaces is released (what they share stays)."""
        self.acquire(entry)  # (first: what it shares with the stack it replaces stays)
        for piece in entry.pieces():
            if piece.name is not None and piece.name not in self._named:
                self._named[piece.name] = piece
        if (previous := self.take(key)) is not None:
            self.release(previous)
        self._entries[key] = entry
        self._entries.move_to_end(key, last=not first_to_go)
        self._put_at[key] = self._clock()
        self.events.held("CPU", key, entry.token_ids)

    def take(self, key: str) -> HostEntry | None:
        """Take `key`'s stack out: the tier's reference passes to the caller, who releases it (or puts it back)."""
        self._put_at.pop(key, None)
        if (entry := self._entries.pop(key, None)) is not None:
            self.events.let_go("CPU", key)
        return entry

    def discard(self, key: str) -> None:
        if (entry := self.take(key)) is not None:
            self.release(entry)

    def acquire(self, entry: HostEntry) -> None:
        """Count one more holder of `entry`'s stack (a caller reading it or building on it): while it holds it, no
        room made and no other release frees a copy of it."""
        for piece in entry.pieces():
            piece.refs += 1

    def release(self, entry: HostEntry) -> None:
        """One holder of `entry`'s stack lets it go: the buffers of its copies that nothing holds any more and that
        are not named for later offloads are free for reuse once a restore still reading them has completed. With
        `forget`, the one path by which a copy is freed."""
        for piece in entry.pieces():
            piece.refs -= 1
            if piece.refs == 0 and self._named.get(piece.name) is not piece:
                self._free(piece)

    def forget(self, piece: HostEntry) -> None:
        """No later offload continues `piece` (it is the least needed, or failed a check); freed once no stack
        includes it."""
        if piece.name is not None and self._named.get(piece.name) is piece:
            del self._named[piece.name]
        if piece.refs == 0:
            self._free(piece)

    def named(self, names: list[str], usable: Callable[[HostEntry], bool] = lambda piece: True) -> HostEntry | None:
        """The `usable` named copy ending at the last of `names` this tier holds (a stack's chunk names, first
        first)."""
        for name in reversed(names):
            if (piece := self._named.get(name)) is not None and usable(piece):
                self._named.move_to_end(name)
                return piece
        return None

    def _free(self, piece: HostEntry) -> None:
        if piece.buffer is not None:
            self.pool.give(piece.buffer, piece.restoring)
            piece.buffer = None
        piece.tensors, piece.scales = [], None  # (nothing reads a freed copy: a check would refuse it)

    def get(self, key: str) -> HostEntry | None:
        return self._entries.get(key)

    def touch(self, key: str) -> None:
        """Count `key` as offloaded now (a segment's copy that a restore used and kept)."""
        self._entries.move_to_end(key)
        self._put_at[key] = self._clock()

    def put_at(self, key: str) -> float:
        return self._put_at[key]

    def used_bytes(self) -> int:
        """The pool's buffers, plus every copy that owns its memory, once (stacks share copies; copies that own
        their memory are rare: offloads write into pool buffers)."""
        owned = {id(piece): piece.nbytes for entry in [*self._entries.values(), *self._named.values()]
                 for piece in entry.pieces() if piece.buffer is None and piece.tensors}
        return self.pool.held_bytes + sum(owned.values())

    def chunk_stats(self) -> dict[str, int]:
        """Named copies held, and those more than one stack includes."""
        return {"host_chunk_copies": len(self._named),
                "host_chunk_copies_shared": sum(piece.refs > 1 for piece in self._named.values())}

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def keys(self) -> list[str]:
        return list(self._entries)
