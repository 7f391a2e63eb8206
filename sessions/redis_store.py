"""Sessions in Redis: they survive restarts and any worker can serve them.

Keys carry a hash tag on the session id (`chatd:{id}:meta`, `…:messages`, `…:tokens`) so that one
session's keys share a Redis Cluster slot and one transaction can update them all. Every write renews
the retention TTL.

When Redis cannot be reached, sessions this worker already holds keep chatting: their completed
turns are recorded locally and queued, and a background task writes them, in order, when Redis
returns. Whatever needs Redis and has no local answer raises `StoreUnavailable`. After a call finds
Redis unreachable, calls skip it for BACK_OFF_S instead of each waiting out the timeouts again (a
hung Redis would otherwise cost every turn several seconds per call); the queue's flusher keeps
trying, and its first success ends the back-off.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Sequence

import redis.asyncio as redis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.exceptions import WatchError

from sessions.encoding import UNREACHABLE, pack_ids, redis_key, unpack_ids
from sessions.redis_client import async_client
from sessions.state import Message, Session, ToolCall, as_inputs, new_session_id
from sessions.store import Lease, LocalLease, SessionBusy, StoreUnavailable, VersionConflict

log = logging.getLogger(__name__)

LOCAL_SESSIONS = 10_000
RETRY_FLUSH_S = 0.5
LEASE_WAIT_S = 2.0
BACK_OFF_S = 5.0
# Take the lease if free, and only then advance the session's fence: returns the new fence or nil.
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local fence = redis.call('INCR', KEYS[2])
  redis.call('PEXPIRE', KEYS[2], ARGV[3])
  return fence
end
return nil
"""
_RENEW = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('PEXPIRE', KEYS[1], ARGV[2]) end return 0"
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


def _all_keys(session_id: str) -> list[str]:
    return [redis_key(session_id, part) for part in ("meta", "messages", "tokens", "lease", "fence")]


class RedisSessionStore:
    """Sessions in Redis, shared by workers and kept across restarts; writes queued through outages."""

    def __init__(self, url: str, retention_s: float, timeout_s: float = 2.0, lease_ttl_s: float = 15.0,
                 cluster: bool = False):
        self.retention_s = int(retention_s)
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.errors = 0  # Redis calls that failed because it could not be reached
        self._redis = async_client(
            url, cluster, socket_timeout=timeout_s, socket_connect_timeout=timeout_s, max_connections=64,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
            retry_on_error=[RedisConnectionError, RedisTimeoutError], health_check_interval=15)
        self._local: OrderedDict[str, Session] = OrderedDict()
        self._pending: deque[tuple[str, Callable[[], Awaitable[None]]]] = deque()
        self._flusher: asyncio.Task | None = None
        self._down_until = float("-inf")  # monotonic time until which calls skip Redis

    # ##### Public API #####

    @property
    def client(self) -> redis.Redis:
        """The connection pool, shared with the prefix index."""
        return self._redis

    def nodes(self) -> dict:
        """Whether Redis is a cluster, and the nodes this worker routes to, with their roles (a cluster's primaries,
        as its client mapped the slots; no call to Redis)."""
        if isinstance(self._redis, AsyncRedisCluster):
            return {"mode": "cluster", "nodes": [{"address": f"{node.host}:{node.port}", "role": node.server_type}
                                                 for node in self._redis.get_nodes()]}
        options = self._redis.connection_pool.connection_kwargs
        return {"mode": "single", "nodes": [{"address": f"{options.get('host')}:{options.get('port')}",
                                             "role": "primary"}]}

    async def create(self, system: str | None, owner: str | None = None, messages: Sequence[Message] = (),
                     tool_options: dict | None = None) -> Session:
        session = Session(session_id=new_session_id(), system=system, owner=owner, messages=list(messages),
                          tool_options=tool_options)
        if self._down():
            raise StoreUnavailable("the session store (Redis) is unreachable")
        try:
            await self._write_new(session)
        except UNREACHABLE as error:
            self._unreachable()
            raise StoreUnavailable("the session store (Redis) is unreachable") from error
        self._remember(session)
        return session

    async def get(self, session_id: str) -> Session | None:
        local = self._local.get(session_id)
        if local is not None and (self._has_pending(session_id) or self._down()):
            return local  # our own queued writes are newer than what Redis has (or Redis is down)
        if self._down():
            raise StoreUnavailable("the session store (Redis) is unreachable")
        try:
            stored = await self._read(session_id)
        except UNREACHABLE as error:
            self._unreachable()
            if local is not None:
                return local
            raise StoreUnavailable("the session store (Redis) is unreachable") from error
        if stored is None:
            self._local.pop(session_id, None)
            return None
        if local is not None and local.version == stored.version:
            return local
        self._remember(stored)
        return stored

    async def lease(self, session_id: str) -> Lease:
        """Take `chatd:{id}:lease` (renewed while held) and a new fence number; wait up to
        LEASE_WAIT_S for another worker's turn to end. With Redis unreachable, a session this worker
        holds keeps chatting without a lease (its writes are queued anyway)."""
        token = secrets.token_hex(8)
        deadline = asyncio.get_running_loop().time() + LEASE_WAIT_S
        while True:
            try:
                if self._down():
                    raise RedisConnectionError("backing off after Redis was unreachable")
                fence = await self._redis.eval(_ACQUIRE, 2, redis_key(session_id, "lease"),
                                               redis_key(session_id, "fence"), token, self.lease_ttl_ms,
                                               int(self.retention_s * 1000))
            except UNREACHABLE as error:
                self._unreachable()
                if session_id in self._local:
                    return LocalLease()
                raise StoreUnavailable("the session store (Redis) is unreachable") from error
            if fence is not None:
                return _RedisLease(self, session_id, token, int(fence))
            if asyncio.get_running_loop().time() >= deadline:
                raise SessionBusy(f"session {session_id} is running a turn on another worker")
            await asyncio.sleep(0.05)

    async def append_turn(self, session: Session, new: str | Sequence[Message], reply: str, token_ids: list[int],
                          lease: Lease | None = None, dropped_turns: int | None = None,
                          reply_ids: Sequence[int] | None = None, tool_calls: Sequence[ToolCall] = ()) -> None:
        write = _Append(self, session.session_id, session.version, as_inputs(new) + [
            Message("assistant", reply, tuple(reply_ids) if reply_ids else None, tuple(tool_calls))],
                        list(token_ids), time.time(), lease.fence if lease is not None else None,
                        session.dropped_turns if dropped_turns is None else dropped_turns)
        if not self._pending and not self._down():
            try:
                await write()
            except UNREACHABLE:
                self._unreachable()
                self._queue(session.session_id, write)
        else:
            self._queue(session.session_id, write)  # keep the order of writes
        session.record_turn(new, reply, token_ids, dropped_turns, reply_ids, tool_calls)
        self._remember(session)

    async def delete(self, session_id: str) -> bool:
        self._local.pop(session_id, None)
        try:
            if self._down():
                raise RedisConnectionError("backing off after Redis was unreachable")
            return bool(await self._redis.delete(*_all_keys(session_id)))
        except UNREACHABLE:
            self._unreachable()
            self._queue(session_id, lambda: self._redis.delete(*_all_keys(session_id)))
            return True

    async def close(self) -> None:
        """Try once more to write what is queued, then close the connection pool."""
        if self._flusher is not None:
            self._flusher.cancel()
        await self._flush(give_up=True)
        await self._redis.aclose()

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    # ##### Helpers #####

    async def _write_new(self, session: Session) -> None:
        meta = redis_key(session.session_id, "meta")
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(meta, mapping={"system": json.dumps(session.system), "version": 0,
                                     "owner": json.dumps(session.owner), "dropped_turns": 0,
                                     "created_at": session.created_at, "updated_at": session.updated_at,
                                     "tool_options": json.dumps(session.tool_options)})
            pipe.expire(meta, self.retention_s)
            if session.messages:
                history = redis_key(session.session_id, "messages")
                pipe.rpush(history, *[_encode_message(m) for m in session.messages])
                pipe.expire(history, self.retention_s)
            await pipe.execute()

    async def _read(self, session_id: str) -> Session | None:
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(redis_key(session_id, "meta"))
            pipe.lrange(redis_key(session_id, "messages"), 0, -1)
            pipe.get(redis_key(session_id, "tokens"))
            meta, messages, tokens = await pipe.execute()
        if not meta:
            return None
        return Session(
            session_id=session_id, system=json.loads(meta[b"system"]),
            messages=[_decode_message(m) for m in messages], token_ids=unpack_ids(tokens),
            version=int(meta[b"version"]), created_at=float(meta[b"created_at"]),
            updated_at=float(meta[b"updated_at"]), owner=json.loads(meta.get(b"owner", b"null")),
            dropped_turns=int(meta.get(b"dropped_turns", 0)),
            tool_options=json.loads(meta.get(b"tool_options", b"null")))

    def _remember(self, session: Session) -> None:
        self._local[session.session_id] = session
        self._local.move_to_end(session.session_id)
        while len(self._local) > LOCAL_SESSIONS:
            self._local.popitem(last=False)

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def _unreachable(self) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + BACK_OFF_S

    def _has_pending(self, session_id: str) -> bool:
        return any(owner == session_id for owner, _ in self._pending)

    def _queue(self, session_id: str, write: Callable[[], Awaitable[None]]) -> None:
        log.warning("Redis unreachable: queued a write of session %s (%d queued)", session_id, len(self._pending) + 1)
        self._pending.append((session_id, write))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())

    async def _flush(self, give_up: bool = False) -> None:
        """Write queued writes in order; wait and retry while Redis is unreachable."""
        while self._pending:
            session_id, write = self._pending[0]
            try:
                await write()
                self._down_until = float("-inf")  # it answers again
            except UNREACHABLE:
                self.errors += 1
                if give_up:
                    log.error("Redis unreachable at shutdown: %d queued writes lost", len(self._pending))
                    return
                await asyncio.sleep(RETRY_FLUSH_S)
                continue
            except VersionConflict:
                log.error("session %s: a queued turn conflicts with another writer; it was not stored", session_id)
            self._pending.popleft()
        log.info("Redis reachable again: queued writes flushed")


class _RedisLease:
    def __init__(self, store: RedisSessionStore, session_id: str, token: str, fence: int):
        self.store, self.session_id, self.token, self.fence = store, session_id, token, fence
        self._renewer = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.store.lease_ttl_ms / 3000)
            try:
                await self.store._redis.eval(_RENEW, 1, redis_key(self.session_id, "lease"), self.token,
                                             self.store.lease_ttl_ms)
            except UNREACHABLE:
                self.store.errors += 1

    async def release(self) -> None:
        self._renewer.cancel()
        if self.store._down():
            return  # it expires by itself
        try:
            await self.store._redis.eval(_RELEASE, 1, redis_key(self.session_id, "lease"), self.token)
        except UNREACHABLE:
            self.store._unreachable()


class _Append:
    """One completed turn, written atomically: messages, token ids, version and times, in one
    transaction that fails if another writer moved the version first."""

    def __init__(self, store: RedisSessionStore, session_id: str, version: int, messages: list[Message],
                 token_ids: list[int], at: float, fence: int | None, dropped_turns: int):
        self.store, self.session_id, self.version, self.fence = store, session_id, version, fence
        self.dropped_turns = dropped_turns
        self.messages = [_encode_message(message) for message in messages]
        self.tokens, self.at = pack_ids(token_ids), at

    async def __call__(self) -> None:
        keys = [redis_key(self.session_id, part) for part in ("meta", "messages", "tokens")]
        try:
            async with self.store._redis.pipeline(transaction=True) as pipe:
                fence_key = redis_key(self.session_id, "fence")
                await pipe.watch(keys[0], fence_key)
                stored = await pipe.hget(keys[0], "version")
                if stored is None or int(stored) != self.version:
                    raise VersionConflict(f"session {self.session_id}: stored version {stored}, "
                                          f"expected {self.version}")
                if self.fence is not None and int(await pipe.get(fence_key) or 0) != self.fence:
                    raise VersionConflict(f"session {self.session_id}: the lease was lost to a newer holder")
                pipe.multi()
                pipe.rpush(keys[1], *self.messages)
                pipe.set(keys[2], self.tokens)
                pipe.hset(keys[0], mapping={"version": self.version + 1, "updated_at": self.at,
                                            "dropped_turns": self.dropped_turns})
                for key in keys:
                    pipe.expire(key, self.store.retention_s)
                await pipe.execute()
        except WatchError:
            raise VersionConflict(f"session {self.session_id}: another writer appended first") from None


def _encode_message(message: Message) -> str:
    fields: dict = {"role": message.role, "content": message.content}
    if message.token_ids is not None:
        fields["ids"] = list(message.token_ids)
    if message.tool_calls:
        fields["calls"] = [[call.id, call.name, call.arguments] for call in message.tool_calls]
    if message.tool_call_id is not None:
        fields["call_id"] = message.tool_call_id
    return json.dumps(fields)


def _decode_message(raw: bytes) -> Message:
    fields = json.loads(raw)
    ids = fields.get("ids")
    return Message(fields["role"], fields["content"], tuple(ids) if ids is not None else None,
                   tuple(ToolCall(*call) for call in fields.get("calls", ())), fields.get("call_id"))
