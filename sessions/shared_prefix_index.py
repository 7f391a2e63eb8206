"""The prefix index shared by every worker through Redis, so that a stateless client's next request finds
its conversation's session whichever worker it reaches.

The same chained block hashes as `PrefixIndex` (seeded with the owner, so one owner's lookups never reach
another owner's sessions), stored as one Redis set per chained hash naming the sessions whose conversation
reaches that block (`chatd:prefix:{<hash>}`, its own hash tag, so any key lives on any Redis Cluster slot
and no command spans two), and per session the chain it last indexed (`chatd:{<id>}:prefix`, beside the
session's other keys). A lookup is two round trips whatever the number of sessions: one pipeline asks
which of the request's blocks exist (the deepest shared block is the end of the leading run), one draws
candidates from the deepest blocks. Every write renews the retention TTL, so the index expires with the
sessions it names; a candidate whose session is gone (ended or expired) is removed when it is met.

Each worker also keeps the index in memory (`PrefixIndex`): with no Redis, or while Redis is unreachable,
lookups use what this worker has seen, exactly as before there was a shared index.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Sequence

import redis.asyncio as redis
from cachetools import LRUCache

from sessions.encoding import UNREACHABLE, pack_hashes, prefix_block_key, redis_key, unpack_hashes
from sessions.prefix_index import MAX_CANDIDATES, PrefixIndex, block_hashes
from sessions.redis_client import RedisEvents

log = logging.getLogger(__name__)
LOCAL_CACHE_KEYS = 100_000  # the prompt cache keys this worker remembers (the oldest forgotten beyond)
BACK_OFF_S = 5.0  # after Redis failed a call, how long the local index answers alone


class SharedPrefixIndex:
    """The prefix index in Redis (when there is one) and in this worker's memory."""

    def __init__(self, client: redis.Redis | None = None, retention_s: float = 0, events: RedisEvents | None = None):
        self.local = PrefixIndex(ttl_s=retention_s or float("inf"))
        self._redis, self._events = client, events
        self._ttl_s = max(1, int(retention_s))
        self.errors = 0  # Redis calls that failed: the local index answered instead
        self._down_until = float("-inf")
        self._cache_keys: LRUCache[str, str] = LRUCache(LOCAL_CACHE_KEYS)  # (owner, prompt_cache_key) -> session id

    def local_state(self) -> dict[str, int]:
        """This worker's own index: the sessions it holds, and those it forgot to stay within its bounds."""
        return {"sessions": len(self.local), "forgotten": self.local.forgotten}

    async def add(self, owner: str | None, session_id: str, token_ids: Sequence[int]) -> None:
        """Index (or re-index) a session by the ids its conversation has reached."""
        self.local.add(owner, session_id, token_ids)
        if not self._shared():
            return
        hashes = block_hashes(owner, token_ids)
        try:
            gone = set(unpack_hashes(await self._redis.get(redis_key(session_id, "prefix")))) - set(hashes)
            async with self._redis.pipeline(transaction=False) as pipe:
                for chained in gone:  # a crop or rollback shortened the conversation
                    pipe.srem(prefix_block_key(chained), session_id)
                for chained in hashes:
                    pipe.sadd(prefix_block_key(chained), session_id)
                    pipe.expire(prefix_block_key(chained), self._ttl_s)
                pipe.set(redis_key(session_id, "prefix"), pack_hashes(hashes), ex=self._ttl_s)
                await pipe.execute()
        except UNREACHABLE as error:
            self._failed("writing to", error)

    async def note_cache_key(self, owner: str | None, cache_key: str, session_id: str) -> None:
        """`cache_key` (OpenAI's `prompt_cache_key`) last ran a turn in `session_id`: the next request with it, on any
        worker, tries that session first."""
        key = _cache_key(owner, cache_key)
        self._cache_keys[key] = session_id
        if self._shared():
            try:
                await self._redis.set(key, session_id, ex=self._ttl_s)
            except UNREACHABLE as error:
                self._failed("writing to", error)

    async def cache_key_session(self, owner: str | None, cache_key: str) -> str | None:
        """The session `cache_key` last ran a turn in, within `owner`'s scope (None: none known)."""
        key = _cache_key(owner, cache_key)
        if self._shared():
            try:
                found = await self._redis.get(key)
                return found.decode() if found is not None else None
            except UNREACHABLE as error:
                self._failed("reading from", error)
        return self._cache_keys.get(key)

    async def remove(self, session_id: str, owner: str | None = None, token_ids: Sequence[int] = ()) -> None:
        """Forget a session (ended, or found gone): from the blocks of the chain it indexed and from those of
        `token_ids` (a request it was drawn for: its chain may have expired before the blocks other
        sessions keep renewing)."""
        self.local.remove(session_id)
        if not self._shared():
            return
        try:
            hashes = {*unpack_hashes(await self._redis.get(redis_key(session_id, "prefix"))),
                      *block_hashes(owner, token_ids)}
            async with self._redis.pipeline(transaction=False) as pipe:
                for chained in hashes:
                    pipe.srem(prefix_block_key(chained), session_id)
                pipe.delete(redis_key(session_id, "prefix"))
                await pipe.execute()
        except UNREACHABLE as error:
            self._failed("removing from", error)

    async def candidates(self, owner: str | None, token_ids: Sequence[int]) -> list[str]:
        """Sessions of `owner` whose conversation shares the most leading blocks with `token_ids`, deepest
        first (at most MAX_CANDIDATES): from Redis, or from this worker's memory when Redis cannot answer."""
        if not self._shared():
            return self.local.candidates(owner, token_ids)
        hashes = block_hashes(owner, token_ids)
        if not hashes:
            return []
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for chained in hashes:
                    pipe.exists(prefix_block_key(chained))
                present = await pipe.execute()
            depth = present.index(0) if 0 in present else len(present)
            deepest = hashes[max(0, depth - MAX_CANDIDATES):depth][::-1]
            async with self._redis.pipeline(transaction=False) as pipe:
                for chained in deepest:
                    pipe.srandmember(prefix_block_key(chained), MAX_CANDIDATES)
                drawn = await pipe.execute()
        except UNREACHABLE as error:
            self._failed("reading", error)
            return self.local.candidates(owner, token_ids)
        found: list[str] = []
        for members in drawn:  # deeper blocks first; within one block in any order
            for member in members:
                session_id = member.decode()
                if session_id not in found:
                    found.append(session_id)
                    if len(found) == MAX_CANDIDATES:
                        return found
        return found

    def _shared(self) -> bool:
        return self._redis is not None and time.monotonic() >= self._down_until

    def _failed(self, what: str, error: Exception) -> None:
        self.errors += 1
        if self._events is not None:
            self._events.error(error)
        self._down_until = time.monotonic() + BACK_OFF_S
        log.warning("%s the shared prefix index failed (%s: %s); this worker's own index answers for %.0f s",
                    what.capitalize(), type(error).__name__, error, BACK_OFF_S)


def _cache_key(owner: str | None, cache_key: str) -> str:
    """Where a prompt cache key's session is named: hashed with its owner (keys never meet across scopes)."""
    digest = hashlib.sha256(json.dumps([owner, cache_key]).encode()).hexdigest()[:32]
    return f"chatd:cache_key:{{{digest}}}"
