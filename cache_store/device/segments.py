"""Shared segments on the device: the system prompts (and branch histories) that caches start with, each held
once in the arena under a key, with its own fingerprint and checksum.

A segment's key is a hash of its token ids seeded with its scope (the owner: another key never finds it,
not even by timing); a warm prompt (`--warm-prompt`) is pinned, never evicted, and found by every owner, since
the operator made it public. A segment lives in the device tier like any cache (counted once in its budget);
it is not evictable while any cache starts with it (`chain.users`, each one of its holders) or while it is
pinned. Every reuse of a cache checks each segment of its chain as a cache is checked: the fingerprint (model,
owner = its key, the digest of its ids), its shapes and lengths, the checksum of its bytes; a segment that fails
is dropped together with every resident cache that starts with it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from cachetools import LRUCache

import cache_store.device.chain as chain
from cache_store.checks.integrity import Check, check_identity, check_tensors, checksum, fingerprint
from cache_store.device.arena import UNIT, ArenaCache
from cache_store.device.device_tier import DeviceTier
from cache_store.device.entry import CacheEntry
from cache_store.identity import CacheLayout
from cache_store.session_notes import REMEMBERED_SESSIONS
from sessions.encoding import token_hash

PREFIX = "prefix:"


def segment_key(token_ids: Sequence[int], scope: str | None) -> str:
    """The key of a segment holding `token_ids`, shared within `scope` (an owner; None: every owner)."""
    return PREFIX + token_hash(token_ids, scope or "")


def is_segment(key: str) -> bool:
    """Whether a tier's key names a shared segment rather than a session."""
    return key.startswith(PREFIX)


class SharedSegments:
    """The shared segments resident in a device tier: made, found, checked and dropped."""

    def __init__(self, device: DeviceTier, model_key: str, layout: CacheLayout):
        self.device, self.model_key, self.layout = device, model_key, layout
        # segment -> the owner it is shared within (None: every owner), while it may be held in a tier
        self._owners: LRUCache[str, str | None] = LRUCache(REMEMBERED_SESSIONS)

    def owner_of(self, key: str) -> str | None:
        """The owner a resident segment is shared within (None: every owner, or not a segment held here)."""
        return self._owners.get(key)

    def share(self, entry: CacheEntry, key: str, pinned: bool = False, tokens: int | None = None,
              owner: str | None = None) -> CacheEntry | None:
        """Make the whole units of `entry`'s own tokens (a system prompt just prefilled alone; or of its first
        `tokens`) a segment under `key`, which `entry` then starts with; nothing is copied. The last tokens that do
        not fill a unit stay in `entry`'s own region (a session that starts from the segment prefills them again: at
        most 15 tokens), so that a segment's region holds no rounding. None when `key` is already held, `entry` is
        not in the arena, or it holds less than a unit (it then keeps its tokens as its own)."""
        tokens = (entry.own_tokens if tokens is None else min(tokens, entry.own_tokens)) // UNIT * UNIT
        if key in self.device or not isinstance(entry.cache, ArenaCache) or tokens <= 0:
            return None
        token_ids = entry.token_ids[:entry.prefix_tokens + tokens]
        segment = CacheEntry(chain.split(entry.cache, tokens), token_ids)
        self.keep(key, segment, pinned, owner)
        return segment

    def keep(self, key: str, segment: CacheEntry, pinned: bool = False, owner: str | None = None) -> None:
        """Stamp a segment just split off a cache and make it resident under `key`, shared within `owner`'s caches:
        the device tier and the cache it was split from hold it (the split's own reference is let go)."""
        self._owners[key] = owner
        segment.cache.segment_key = key
        self.stamp(key, segment)
        self.device.put(key, segment, pinned=pinned)
        segment.release()

    def stamp(self, key: str, segment: CacheEntry) -> None:
        """The fingerprint and checksum a segment is checked against on every reuse."""
        segment.fingerprint = fingerprint(segment, self.model_key, key, self.layout)
        segment.checksum = checksum(segment.tensors())

    def find(self, key: str, token_ids: Sequence[int]) -> tuple[CacheEntry | None, tuple[Check, ...]]:
        """The resident segment `key` if it holds the first of `token_ids` (verified, never trusted by its hash)
        and passes its checks; else None, with the checks it failed (the caller reports and drops it)."""
        segment = self.device.get(key)
        if segment is None or segment.token_ids != list(token_ids[:segment.num_tokens]):
            return None, ()
        if failed := self.check(key, segment):
            return None, failed
        return segment, ()

    def check(self, key: str, segment: CacheEntry) -> tuple[Check, ...]:
        """Every check of a resident segment, its checksum included."""
        failed = (check_identity(segment.fingerprint, self.model_key, key, segment.token_ids, self.layout)
                  or check_tensors(segment.tensors(), segment.own_tokens, self.layout)
                  or (checksum(segment.tensors()) != segment.checksum and "checksum"))
        return (failed,) if failed else ()

    def missing(self, entry: CacheEntry) -> str | None:
        """The key of the first segment `entry` starts with that is no longer resident under its key, or holds
        other ids than `entry` starts with; None when every one is in place (no bytes read)."""
        if not isinstance(entry.cache, ArenaCache):
            return None
        for segment in chain.segments(entry.cache):
            held = self.device.peek(segment.segment_key) if segment.segment_key else None
            if held is None or held.cache is not segment or held.token_ids != entry.token_ids[:held.num_tokens]:
                return segment.segment_key
        return None

    def check_chain(self, entry: CacheEntry) -> tuple[str | None, tuple[Check, ...]]:
        """Check every segment `entry` starts with, the root first: (the key of the first that fails, its
        failed checks). A segment that is no longer in place (`missing`) fails `fingerprint`."""
        if (key := self.missing(entry)) is not None:
            return key, ("fingerprint",)
        for segment in chain.segments(entry.cache) if isinstance(entry.cache, ArenaCache) else ():
            held = self.device.get(segment.segment_key)  # (an access: the segment is in use)
            if failed := self.check(segment.segment_key, held):
                return segment.segment_key, failed
        return None, ()

    def drop(self, key: str) -> list[str]:
        """Drop the segment `key` and every resident cache that starts with it (their turns recompute, or
        find it again); return the keys of those caches."""
        segment = self.device.peek(key)
        if segment is None:
            return []
        dependents = [other for other in self.device
                      if (entry := self.device.peek(other)) is not None and _starts_with(entry, segment.cache)]
        for other in [key, *dependents]:
            self.device.discard(other)
        self._owners.pop(key, None)
        return dependents

    def keys(self) -> Iterator[str]:
        return (key for key in self.device if is_segment(key))

    def stats(self) -> dict[str, int]:
        """Segments held, the sessions that start with them, their tokens, and the tokens the sessions'
        caches would hold as private copies."""
        held = [self.device.peek(key) for key in self.keys()]
        sessions = [self.device.peek(key) for key in self.device if not is_segment(key)]
        return {"segments": len(held), "segments_pinned": sum(self.device.is_pinned(key) for key in self.keys()),
                "segment_users": sum(chain.users(entry.cache) for entry in held if isinstance(entry.cache, ArenaCache)),
                "segment_tokens": sum(entry.own_tokens for entry in held),
                "shared_sessions": sum(1 for entry in sessions if entry.prefix_tokens),
                "private_tokens": sum(entry.num_tokens for entry in sessions)}


def _starts_with(entry: CacheEntry, segment: ArenaCache) -> bool:
    return isinstance(entry.cache, ArenaCache) and segment in chain.segments(entry.cache)
