"""Caches resident on the compute device, under a byte budget that counts every running turn's
cache at the size it may reach, from its admission to its write-back. A shared segment counts once, and is
not evictable while a cache starts with it or while it is pinned (a warm prompt).

The tier is one holder of each cache it keeps (`ArenaCache.refs`): `put` acquires, `discard` releases, `pop` hands
the tier's reference to the caller, who releases it when done with the cache."""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterator

import cache_store.device.chain as chain
from cache_store.device.arena import ArenaCache
from cache_store.device.entry import CacheEntry
from cache_store.device.eviction import ConnectedLRUPolicy, EvictionPolicy, Residency
from cache_store.tier_events import NO_EVENTS, TierEvents


class DeviceTier:
    """Caches on the compute device, their residency and reservations, under the device budget."""

    def __init__(self, budget_bytes: int, policy: EvictionPolicy | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.budget_bytes = budget_bytes
        self.policy = policy or ConnectedLRUPolicy()
        self._clock = clock
        self._entries: dict[str, CacheEntry] = {}
        self._residency: dict[str, Residency] = {}
        self._reserved: dict[str, int] = {}  # running turns: the bytes each one's cache may grow to
        self._pinned: set[str] = set()  # warm prompts: resident through any eviction
        self.events: TierEvents = NO_EVENTS  # told what the tier holds (KV events), as it changes

    def get(self, key: str) -> CacheEntry | None:
        if (entry := self._entries.get(key)) is not None:
            self._residency[key].last_access = self._clock()
        return entry

    def peek(self, key: str) -> CacheEntry | None:
        """The entry, without recording an access (for stats and scans)."""
        return self._entries.get(key)

    def put(self, key: str, entry: CacheEntry, connected: bool = False, pinned: bool = False) -> None:
        """Make `entry` resident (`pinned`: never evicted), held by the tier (the entry it replaces, if any, is let
        go). The caller makes room first (see `plan_room`)."""
        if pinned:
            self._pinned.add(key)
        replaced = self._entries.get(key)
        self._entries[key] = entry.acquire()
        if replaced is not None:
            replaced.release()
        residency = self._residency.setdefault(key, Residency(key, self._clock()))
        residency.last_access, residency.connected = self._clock(), connected
        residency.running = key in self._reserved
        self.events.held("GPU", key, entry.token_ids)

    def cropped(self, key: str) -> None:
        """`key`'s entry was cropped in place (a lookup kept what the prompt shares with it): its positions after the
        crop are no longer held."""
        if (entry := self._entries.get(key)) is not None:
            self.events.held("GPU", key, entry.token_ids)

    def pop(self, key: str) -> CacheEntry | None:
        """Take the entry off the device, with the tier's reference (the caller releases it); a running turn's
        reservation stays until `unreserve`."""
        self._residency.pop(key, None)
        self._pinned.discard(key)
        if (entry := self._entries.pop(key, None)) is not None:
            self.events.let_go("GPU", key)
        return entry

    def discard(self, key: str) -> None:
        """Take the entry off the device and let it go (freed unless another holder, such as its running turn or a
        cache that starts with it, still holds it)."""
        if (entry := self.pop(key)) is not None:
            entry.release()

    def reserve(self, key: str, nbytes: int) -> None:
        """A turn of `key` runs: count its cache as at least `nbytes`, and never evict it."""
        self._reserved[key] = max(nbytes, self._reserved.get(key, 0))
        if (residency := self._residency.get(key)) is not None:
            residency.running = True

    def unreserve(self, key: str) -> None:
        self._reserved.pop(key, None)
        if (residency := self._residency.get(key)) is not None:
            residency.running = False

    def is_running(self, key: str) -> bool:
        return key in self._reserved

    def is_pinned(self, key: str) -> bool:
        return key in self._pinned

    def is_evictable(self, key: str) -> bool:
        """Not running, not pinned, and not a segment that a cache starts with."""
        entry = self._entries.get(key)
        return (entry is not None and key not in self._reserved and key not in self._pinned
                and not (isinstance(entry.cache, ArenaCache) and entry.cache.frozen and chain.users(entry.cache)))

    def residency(self, key: str) -> Residency | None:
        return self._residency.get(key)

    def charge(self, key: str) -> int:
        """The bytes `key` counts for: its entry's, or its reservation when that is larger."""
        entry = self._entries.get(key)
        return max(entry.nbytes() if entry is not None else 0, self._reserved.get(key, 0))

    def extra_bytes(self, key: str, nbytes: int) -> int:
        """How much more `key` would count for if it held `nbytes`."""
        return max(0, max(nbytes, self._reserved.get(key, 0)) - self.charge(key))

    def plan_room(self, need_bytes: int, keep: str | Collection[str] = ()) -> tuple[list[str], bool]:
        """Keys to evict, in eviction order, so that `need_bytes` more fit under the budget, and whether
        they suffice. Running caches, pinned ones and `keep` (a key or several) are never chosen; a segment is
        chosen only once every cache that starts with it is (then it competes with what is left)."""
        keep = {keep} if isinstance(keep, str) else set(keep)
        over = self.used_bytes() + need_bytes - self.budget_bytes
        chosen: list[str] = []
        if over <= 0:
            return chosen, True
        leaving: Counter[int] = Counter()  # id of a segment -> how many of its users are chosen
        # One at a time, in priority order (a heap: each cache ranked once): a segment joins the candidates when its
        # last user is chosen and competes with the rest from then on, so a cache kept ahead of LRU outlasts the
        # segments of the caches evicted before it.
        heap = [(self.policy.priority(residency), order, residency.key)
                for order, residency in enumerate(self._residency.values())
                if residency.key not in keep and self._evictable_with(residency.key, leaving)]
        heapq.heapify(heap)
        segments = {id(entry.cache): key for key, entry in self._entries.items()
                    if isinstance(entry.cache, ArenaCache) and entry.cache.frozen}
        while over > 0 and heap:
            _, _, victim = heapq.heappop(heap)
            chosen.append(victim)
            over -= self._entries[victim].nbytes()
            prefix = self._entries[victim].cache.prefix if isinstance(self._entries[victim].cache, ArenaCache) \
                else None
            if prefix is not None:
                leaving[id(prefix)] += 1
                if (key := segments.get(id(prefix))) is not None and key not in keep \
                        and self._evictable_with(key, leaving):
                    heapq.heappush(heap, (self.policy.priority(self._residency[key]), len(self._residency), key))
        return chosen, over <= 0

    def can_fit(self, need_bytes: int) -> bool:
        """Whether evicting everything that may be evicted would leave room for `need_bytes` (a segment in
        use stays: what uses it may be evicted first, but it is counted as staying, which errs on the safe side)."""
        staying = {*self._reserved, *(key for key in self._entries if not self.is_evictable(key))}
        return sum(self.charge(key) for key in staying) + need_bytes <= self.budget_bytes

    def _evictable_with(self, key: str, leaving: Counter[int]) -> bool:
        """Whether `key` may be evicted once the caches chosen so far (`leaving`: their segments' ids, counted) are
        gone: a segment once every user it has is among them."""
        entry = self._entries[key]
        if key in self._reserved or key in self._pinned:
            return False
        frozen = isinstance(entry.cache, ArenaCache) and entry.cache.frozen
        return not frozen or leaving[id(entry.cache)] >= chain.users(entry.cache)

    def used_bytes(self) -> int:
        return sum(self.charge(key) for key in {*self._entries, *self._reserved})

    def active_bytes(self) -> int:
        """What no eviction can free now, as vLLM counts a block in use (one a running request references): running
        turns' caches at the size they may reach, and pinned prompts. An idle cache is free room that holds a
        cache until it is needed."""
        return sum(self.charge(key) for key in {*self._reserved, *self._pinned})

    def reserved_bytes(self) -> int:
        """What running turns count for beyond the caches they hold now."""
        return self.used_bytes() - sum(entry.nbytes() for entry in self._entries.values())

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))
