"""Sessions in Redis: they survive restarts and any worker can serve them.

Keys carry a hash tag on the session id (`chatd:{id}:meta`, `…:messages`, `…:tokens`) so that one
session's keys share a Redis Cluster slot and one transaction can update them all. Every write renews
the retention TTL.

A completed turn is one Lua script (version and fence checked, messages, token ids and times written
together: never half-applied, and the turn's lease let go in the same round trip), which a retry cannot
apply twice (it names its write). With
`wait_replicas` (where Redis has replicas: a cluster's failover), the script is followed on the same
connection by `WAIT`, so that a turn is acknowledged once a replica holds it; Redis is then the only
truth: a write that cannot reach its node is retried through a failover for up to `failover_s`, then
the turn is answered `unavailable` (retryable) and nothing of it is kept.

Without replicas to wait for, when Redis cannot be reached, sessions this worker already holds keep
chatting: their completed turns are recorded locally and queued, and a background task writes them,
in order, when Redis returns. Whatever needs Redis and has no local answer raises `StoreUnavailable`.
After a call finds a single Redis unreachable, calls skip it for BACK_OFF_S instead of each waiting
out the timeouts again (a hung Redis would otherwise cost every turn several seconds per call); the
queue's flusher keeps trying, and its first success ends the back-off. (A cluster's outage is one
node's: its client routes around it, and no back-off stops the others; durable calls retry instead.)
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

import redis.asyncio as redis
from cachetools import LRUCache
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sessions import redis_scripts as scripts
from sessions.encoding import UNREACHABLE, pack_ids, redis_key, unpack_ids
from sessions.redis_client import RedisEvents, async_client, write_and_wait
from sessions.state import Message, Session, ToolCall, new_session_id, turn_messages
from sessions.store import Lease, LocalLease, SessionBusy, StoreUnavailable, VersionConflict

log = logging.getLogger(__name__)
T = TypeVar("T")

LOCAL_SESSIONS = 10_000
RETRY_FLUSH_S = 0.5
LEASE_WAIT_S = 2.0
BACK_OFF_S = 5.0
FAILOVER_RETRY_S = 0.25  # between retries of a durable write whose node cannot answer
def _all_keys(session_id: str) -> list[str]:
    return [redis_key(session_id, part) for part in ("meta", "messages", "tokens", "lease", "fence")]


class RedisSessionStore:
    """Sessions in Redis, shared by workers and kept across restarts; writes queued through outages."""

    def __init__(self, url: str, retention_s: float, timeout_s: float = 2.0, lease_ttl_s: float = 15.0,
                 cluster: bool = False, wait_replicas: int = 0, wait_timeout_ms: int = 500,
                 failover_s: float = 10.0, events: RedisEvents | None = None):
        self.retention_s = int(retention_s)
        self.lease_ttl_ms = int(lease_ttl_s * 1000)
        self.errors = 0  # Redis calls that failed because it could not be reached
        self.conflicts = 0  # queued turns refused when flushed (another writer moved the session on)
        self.events = events or RedisEvents()
        self.wait_replicas, self.wait_timeout_ms, self.failover_s = wait_replicas, wait_timeout_ms, failover_s
        self._cluster = cluster
        # A write's WAIT may take its whole timeout before it answers: the connection waits that long more.
        read_timeout_s = timeout_s + (wait_timeout_ms / 1000 if wait_replicas else 0.0)
        self._redis = async_client(
            url, cluster, self.events, socket_timeout=read_timeout_s, socket_connect_timeout=timeout_s,
            max_connections=64,
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
            retry_on_error=[RedisConnectionError, RedisTimeoutError], health_check_interval=15)
        self._local: LRUCache[str, Session] = LRUCache(LOCAL_SESSIONS)
        self._pending: deque[tuple[str, Callable[[], Awaitable[None]]]] = deque()
        self._flusher: asyncio.Task | None = None
        # One writer of the queue at a time (two would both write its head); at shutdown the background one stops
        # retrying, so that the last try is the shutdown's own.
        self._flushing = asyncio.Lock()
        self._stopping = False
        self._down_until = float("-inf")  # monotonic time until which calls skip Redis
        self._unreleased: dict[str, str] = {}  # session id -> the token of a lease a release could not reach

    # ##### Public API #####

    @property
    def client(self) -> redis.Redis:
        """The connection pool, shared with the prefix index."""
        return self._redis

    @property
    def durable(self) -> bool:
        """Whether a write is acknowledged only once replicas hold it (and never queued in this worker)."""
        return self.wait_replicas > 0

    def state(self) -> dict:
        """Whether Redis is a cluster, the nodes this worker routes to with their roles (a cluster's primaries and
        replicas, as its client mapped the slots), the replicas a turn waits for, and what the clients met (no call
        to Redis)."""
        if isinstance(self._redis, AsyncRedisCluster):
            mode, nodes = "cluster", [{"address": f"{node.host}:{node.port}", "role": node.server_type}
                                      for node in self._redis.get_nodes()]
        else:
            options = self._redis.connection_pool.connection_kwargs
            mode, nodes = "single", [{"address": f"{options.get('host')}:{options.get('port')}", "role": "primary"}]
        return {"mode": mode, "nodes": nodes, "wait_replicas": self.wait_replicas,
                "reachable": not self._down() and not self._pending, "pending_writes": len(self._pending),
                "wait_timeout_ms": self.wait_timeout_ms, "queued_turns_refused": self.conflicts,
                **self.events.snapshot()}

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
            stored = await self._call(lambda: self._read(session_id))
        except UNREACHABLE as error:
            self._unreachable()
            if local is not None and not self.durable:  # (durable: another worker may have moved it on)
                return local
            raise StoreUnavailable("the session store (Redis) is unreachable") from error
        return self._adopt(session_id, stored)

    async def lease(self, session_id: str) -> Lease:
        """Take `chatd:{id}:lease` (renewed while held) and a new fence number, and read the session in the same
        round trip (`Lease.session`); wait up to LEASE_WAIT_S for another worker's turn to end. With Redis
        unreachable, a session this worker holds keeps chatting without a lease (its writes are queued anyway),
        unless turns are durable."""
        token = secrets.token_hex(8)
        deadline = asyncio.get_running_loop().time() + LEASE_WAIT_S
        while True:
            try:
                if self._down():
                    raise RedisConnectionError("backing off after Redis was unreachable")
                taken = await self._call(lambda: self._redis.eval(
                    scripts.ACQUIRE, 5,
                    *[redis_key(session_id, part) for part in ("lease", "fence", "meta", "messages", "tokens")],
                    token, self.lease_ttl_ms, int(self.retention_s * 1000), self._unreleased.get(session_id, ""),
                    "0" if self._has_pending(session_id) else "1"))
            except UNREACHABLE as error:
                self._unreachable()
                if session_id in self._local and not self.durable:
                    return LocalLease()
                raise StoreUnavailable("the session store (Redis) is unreachable") from error
            if taken == 0:  # no such session (and none of this worker's queued writes creates it): no lease taken
                return LocalLease()
            if taken is not None:
                self._unreleased.pop(session_id, None)
                fence, fields, messages, tokens = taken
                # (this worker's queued writes are newer than what Redis holds)
                session = self._local.get(session_id) if self._has_pending(session_id) else \
                    self._adopt(session_id, _session(session_id, fields, messages, tokens))
                return _RedisLease(self, session_id, token, int(fence), session)
            if asyncio.get_running_loop().time() >= deadline:
                raise SessionBusy(f"session {session_id} is running a turn on another worker")
            await asyncio.sleep(0.05)

    async def append_turn(self, session: Session, new: str | Sequence[Message], reply: str | None,
                          token_ids: list[int], lease: Lease | None = None, dropped_turns: int | None = None,
                          reply_ids: Sequence[int] | None = None, tool_calls: Sequence[ToolCall] = ()) -> None:
        messages = turn_messages(new, reply, reply_ids or None, tool_calls)
        write = _Append(self, session.session_id, session.version, messages, list(token_ids), time.time(),
                        lease if isinstance(lease, _RedisLease) else None,
                        session.dropped_turns if dropped_turns is None else dropped_turns)
        if self.durable:
            try:
                await write()  # (retried through a failover, up to `failover_s`)
            except UNREACHABLE as error:
                self._unreachable()
                raise StoreUnavailable("the session store (Redis) could not record the turn") from error
        elif not self._pending and not self._down():
            try:
                await write()
            except UNREACHABLE:
                self._unreachable()
                self._queue(session.session_id, write)
        else:
            self._queue(session.session_id, write)  # keep the order of writes
        session.record_turn(new, reply, token_ids, dropped_turns, reply_ids, tool_calls)
        self._remember(session)

    async def rewrite(self, session: Session, system: str | None, messages: Sequence[Message], removed_items: int,
                      dropped_turns: int) -> None:
        """One script (version checked, refused while a lease is held); not queued: an edit waits for Redis."""
        if self._has_pending(session.session_id) or self._down():
            raise StoreUnavailable("the session store (Redis) is unreachable")
        keys = [redis_key(session.session_id, part) for part in ("meta", "messages", "tokens", "lease")]
        try:
            outcome = await self.write(keys[0], (
                "EVAL", scripts.REWRITE, len(keys), *keys, session.version, self.retention_s, repr(time.time()),
                json.dumps(system), removed_items, dropped_turns, *[_encode_message(m) for m in messages]))
        except UNREACHABLE as error:
            self._unreachable()
            raise StoreUnavailable("the session store (Redis) is unreachable") from error
        outcome = outcome.decode() if isinstance(outcome, bytes) else outcome
        if outcome == "busy":
            raise SessionBusy(f"session {session.session_id} is running a turn on another worker")
        if outcome != "ok":
            raise VersionConflict(f"session {session.session_id}: {outcome}")
        session.rewrite(system, messages, removed_items, dropped_turns)
        self._remember(session)

    async def delete(self, session_id: str) -> bool:
        self._local.pop(session_id, None)
        try:
            if self._down():
                raise RedisConnectionError("backing off after Redis was unreachable")
            return bool(await self._call(lambda: self._redis.delete(*_all_keys(session_id))))
        except UNREACHABLE as error:
            self._unreachable()
            if self.durable:
                raise StoreUnavailable("the session store (Redis) is unreachable") from error
            self._queue(session_id, lambda: self._call(lambda: self._redis.delete(*_all_keys(session_id))))
            return True

    async def reachable(self) -> bool:
        """Redis answers a PING (within the client's timeout)."""
        try:
            return bool(await self._redis.ping())
        except UNREACHABLE:
            return False

    async def flush(self) -> None:
        """Try once to write what is queued (at shutdown, before anything slower: the conversations first)."""
        self._stopping = True
        await self._flush(give_up=True)

    async def close(self) -> None:
        """Try once more to write what is queued, then close the connection pool."""
        self._stopping = True
        await self._flush(give_up=True)
        if self._flusher is not None:
            self._flusher.cancel()
        await self._redis.aclose()

    @property
    def pending_writes(self) -> int:
        return len(self._pending)

    async def beside(self, command: Awaitable[T], store: str) -> T:
        """A call of a store kept beside the sessions on the same Redis (responses, threads): an unreachable Redis is
        counted and raised as `StoreUnavailable` naming `store`."""
        try:
            return await command
        except UNREACHABLE as error:
            self.events.error(error)
            raise StoreUnavailable(f"the {store} store (Redis) is unreachable") from error

    # ##### Helpers #####

    async def _write_new(self, session: Session) -> None:
        meta = {"system": json.dumps(session.system), "version": "0", "owner": json.dumps(session.owner),
                "dropped_turns": "0", "created_at": repr(session.created_at), "updated_at": repr(session.updated_at),
                "tool_options": json.dumps(session.tool_options)}
        keys = [redis_key(session.session_id, "meta"), redis_key(session.session_id, "messages")]
        await self.write(keys[0], ("EVAL", scripts.CREATE, 2, *keys, self.retention_s, json.dumps(meta),
                                   *[_encode_message(m) for m in session.messages]))

    async def write(self, key: str, command: tuple):
        """One write command (its keys in `key`'s slot; every write here is one command, which a retry cannot
        apply twice). Durable: acknowledged once `wait_replicas` replicas hold it, and retried through a failover."""
        return await self._call(lambda: write_and_wait(self._redis, key, command, self.wait_replicas,
                                                       self.wait_timeout_ms, self.events))

    async def _call(self, call: Callable[[], Awaitable[T]]) -> T:
        """Call Redis, counting what fails. Durable: retried while the node cannot answer (a failover takes
        seconds), for up to `failover_s`; then what it raised is raised."""
        deadline = time.monotonic() + self.failover_s
        while True:
            try:
                return await call()
            except UNREACHABLE as error:
                self.events.error(error)
                if not self.durable or time.monotonic() >= deadline:
                    raise
            self.events.retry()
            await asyncio.sleep(FAILOVER_RETRY_S)

    async def _read(self, session_id: str) -> Session | None:
        keys = [redis_key(session_id, part) for part in ("meta", "messages", "tokens")]
        return _session(session_id, *await self._redis.eval(scripts.READ, len(keys), *keys))

    def _adopt(self, session_id: str, stored: Session | None) -> Session | None:
        """A session as Redis holds it, kept as this worker's copy (the same object while its version is)."""
        if stored is None:
            self._local.pop(session_id, None)
            return None
        local = self._local.get(session_id)
        if local is not None and local.version == stored.version:
            return local
        self._remember(stored)
        return stored

    def _remember(self, session: Session) -> None:
        self._local[session.session_id] = session

    def _unreleased_lease(self, session_id: str, token: str) -> None:
        self._unreleased[session_id] = token
        while len(self._unreleased) > LOCAL_SESSIONS:
            self._unreleased.pop(next(iter(self._unreleased)))

    def _down(self) -> bool:
        return time.monotonic() < self._down_until

    def _unreachable(self) -> None:
        """After a call found Redis unreachable (the error was counted by `_call`)."""
        self.errors += 1
        if not self._cluster and not self.durable:
            self._down_until = time.monotonic() + BACK_OFF_S

    def _has_pending(self, session_id: str) -> bool:
        return any(owner == session_id for owner, _ in self._pending)

    def _queue(self, session_id: str, write: Callable[[], Awaitable[None]]) -> None:
        log.warning("Redis unreachable: queued a write of session %s (%d queued)", session_id, len(self._pending) + 1)
        self._pending.append((session_id, write))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.create_task(self._flush())

    async def _flush(self, give_up: bool = False) -> None:
        """Write queued writes in order; wait and retry while Redis is unreachable (until shutdown)."""
        async with self._flushing:
            await self._write_queued(give_up)

    async def _write_queued(self, give_up: bool) -> None:
        while self._pending:
            session_id, write = self._pending[0]
            try:
                await write()
                self._down_until = float("-inf")  # it answers again
            except UNREACHABLE:  # (counted by `_call`)
                self.errors += 1
                if give_up:
                    log.error("Redis unreachable at shutdown: %d queued writes lost", len(self._pending))
                    return
                if self._stopping:  # (the shutdown's own try comes next)
                    return
                await asyncio.sleep(RETRY_FLUSH_S)
                continue
            except VersionConflict:
                # Another writer moved the session on: this worker's copy (and its later queued turns, which build
                # on the refused one) would diverge from Redis, so they go, and the session is read again.
                log.error("session %s: a queued turn conflicts with another writer; it and %d later queued turns of "
                          "the session were not stored, and the session is read again from Redis", session_id,
                          sum(owner == session_id for owner, _ in self._pending) - 1)
                self._down_until = float("-inf")  # (it answered)
                self._local.pop(session_id, None)
                self._pending = deque(item for item in self._pending if item[0] != session_id)
                self.conflicts += 1
                continue
            self._pending.popleft()
        log.info("Redis reachable again: queued writes flushed")


class _RedisLease:
    def __init__(self, store: RedisSessionStore, session_id: str, token: str, fence: int, session: Session | None):
        self.store, self.session_id, self.token, self.fence = store, session_id, token, fence
        self.session = session
        self._released = False
        self._renewer = asyncio.create_task(self._renew())

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.store.lease_ttl_ms / 3000)
            try:
                await self.store._redis.eval(scripts.RENEW, 1, redis_key(self.session_id, "lease"), self.token,
                                             self.store.lease_ttl_ms)
            except UNREACHABLE as error:
                self.store.errors += 1
                self.store.events.error(error)

    def let_go(self) -> None:
        """The turn's write let the lease go in Redis (in its own round trip): nothing more to tell Redis."""
        self._released = True
        self._renewer.cancel()

    async def release(self) -> None:
        """Free the session (once: a second call does nothing); one Redis cannot be told of expires by itself, or
        this worker's next turn of the session takes it over."""
        if self._released:
            return
        self.let_go()
        if self.store._down():
            self.store._unreleased_lease(self.session_id, self.token)
            return
        try:
            await self.store._redis.eval(scripts.RELEASE, 1, redis_key(self.session_id, "lease"), self.token)
        except UNREACHABLE as error:
            self.store.events.error(error)
            self.store._unreachable()
            self.store._unreleased_lease(self.session_id, self.token)


class _Append:
    """One completed turn, written atomically by a script: messages, token ids, version and times, refused if
    another writer moved the version (or took the lease) first, and applied once however often it is retried."""

    def __init__(self, store: RedisSessionStore, session_id: str, version: int, messages: list[Message],
                 token_ids: list[int], at: float, lease: _RedisLease | None, dropped_turns: int):
        self.store, self.session_id, self.version, self.lease = store, session_id, version, lease
        self.fence = lease.fence if lease is not None else None
        self.dropped_turns = dropped_turns
        self.messages = [_encode_message(message) for message in messages]
        self.tokens, self.at = pack_ids(token_ids), at
        self.write_id = secrets.token_hex(8)

    async def __call__(self) -> None:
        keys = [redis_key(self.session_id, part) for part in ("meta", "messages", "tokens", "fence", "lease")]
        outcome = await self.store.write(keys[0], (
            "EVAL", scripts.APPEND, len(keys), *keys, self.version, "" if self.fence is None else self.fence,
            self.store.retention_s, repr(self.at), self.dropped_turns, self.write_id, self.tokens,
            "" if self.lease is None else self.lease.token, *self.messages))
        outcome = outcome.decode() if isinstance(outcome, bytes) else outcome
        if outcome in ("ok", "done") and self.lease is not None:
            self.lease.let_go()  # (the script let it go)
        if outcome == "fence":
            raise VersionConflict(f"session {self.session_id}: the lease was lost to a newer holder")
        if outcome not in ("ok", "done"):
            stored = outcome.removeprefix("version ") if outcome != "gone" else None
            raise VersionConflict(f"session {self.session_id}: stored version {stored}, expected {self.version}")


def _session(session_id: str, fields: list, messages: list, tokens: bytes | None) -> Session | None:
    """A session from its keys as a script read them (None: gone)."""
    if not fields:
        return None
    meta = dict(zip(fields[::2], fields[1::2], strict=True))
    return Session(
        session_id=session_id, system=json.loads(meta[b"system"]),
        messages=[_decode_message(m) for m in messages], token_ids=unpack_ids(tokens),
        version=int(meta[b"version"]), created_at=float(meta[b"created_at"]),
        updated_at=float(meta[b"updated_at"]), owner=json.loads(meta.get(b"owner", b"null")),
        dropped_turns=int(meta.get(b"dropped_turns", 0)), removed_items=int(meta.get(b"removed_items", 0)),
        tool_options=json.loads(meta.get(b"tool_options", b"null")))


def _encode_message(message: Message) -> str:
    fields: dict = {"role": message.role, "content": message.content}
    if message.token_ids is not None:
        fields["ids"] = list(message.token_ids)
    if message.tool_calls:
        fields["calls"] = [[call.id, call.name, call.arguments] for call in message.tool_calls]
    if message.tool_call_id is not None:
        fields["call_id"] = message.tool_call_id
    if message.item is not None:
        fields["item"] = message.item
    return json.dumps(fields)


def _decode_message(raw: bytes) -> Message:
    fields = json.loads(raw)
    ids = fields.get("ids")
    return Message(fields["role"], fields["content"], tuple(ids) if ids is not None else None,
                   tuple(ToolCall(*call) for call in fields.get("calls", ())), fields.get("call_id"),
                   fields.get("item"))
