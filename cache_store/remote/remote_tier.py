"""Caches in Redis, shared by every worker: a session can move to another worker (or survive a restart) without
recomputing its history, when fetching is cheaper than recomputing. What they look like there: `remote_format.py`.

A write renews the chunks Redis holds and sends only those it lacks, then the session's bytes, then its header, so
a reader that finds a header finds its bytes unless they expired; one whose bytes are gone is deleted and counts as
a miss, and a chunk gone or damaged ends what a reader takes from the run there.

No Redis call is made on the engine thread: fetches run on reader threads (the engine polls them), writes and
deletes on writer threads, in order per key, from a queue bounded in bytes and in age (a session's newest snapshot
only).
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Literal, NamedTuple, TypeVar

import xxhash
from cachetools import LRUCache
from redis.cluster import RedisCluster
from redis.exceptions import ResponseError

from cache_store.remote.cost_model import Throughput
from cache_store.remote.remote_format import (
    DELETE_SESSION,
    RemoteCopy,
    RemoteHeader,
    RemoteSnapshot,
    chunk_key,
    copy_from,
    header_from,
)
from cache_store.remote.remote_writes import write_snapshot
from cache_store.units import CHUNK_TOKENS
from sessions.encoding import UNREACHABLE, redis_key
from sessions.redis_client import sync_client

log = logging.getLogger(__name__)
T = TypeVar("T")

PROBE_BYTES = 4 * 2**20
BACK_OFF_S = 5.0  # after a failure, turns skip the remote tier this long instead of waiting on Redis
USAGE_EVERY_S = 5.0
CHUNKS_REMEMBERED = 100_000  # chunks this tier remembers Redis holding (beyond: the oldest are sent again)
READERS = 8  # threads that fetch (and read the memory figure): each waits on a round trip, not on a core
WRITERS = 4  # threads that write and delete (a key's ops all on one, in order)
PENDING_BYTES = 256 * 2**20  # snapshots queued for writing, at most (while Redis is slow or down)
PENDING_AGE_S = 30.0  # a snapshot queued longer is dropped unwritten (its turn stopped waiting long before)
MAX_QUEUED_DELETES = 100_000
DROP_REASONS = ("full", "expired", "deletes")  # why a queued write was not made: no room, too old, delete queue full


class _Op(NamedTuple):
    """A writer's op: `put` the session's snapshot queued with `ticket`, `delete` the session's copy if its version
    is at most `version`, or `delete_chunk`."""

    kind: Literal["put", "delete", "delete_chunk"]
    key: str
    ticket: int = 0
    version: int = 0


@dataclass(frozen=True)
class _Pending:
    """A session's newest snapshot, queued for writing (`ticket`: the queued op that writes it)."""

    snapshot: RemoteSnapshot
    ticket: int
    queued_at: float
    nbytes: int


class RemoteTier:
    """Caches in Redis as runs of chunks, shared by every worker. No call to Redis is made on the caller's thread:
    fetches (`submit`) and the memory figure run on reader threads, snapshots and deletes on a writer thread, from
    a queue bounded in bytes and age (what does not fit, or waits too long, is dropped and counted)."""

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 1.0, chunk_tokens: int = CHUNK_TOKENS,
                 cluster: bool = False, pending_bytes: int = PENDING_BYTES, pending_age_s: float = PENDING_AGE_S):
        self.ttl_s = int(ttl_s)
        self.timeout_s = timeout_s
        self.chunk_tokens = chunk_tokens
        self.pending_budget_bytes, self.pending_age_s = pending_bytes, pending_age_s
        self.throughput = Throughput()
        self.errors = 0  # reads that failed
        self.write_errors = 0  # snapshots that could not be written
        self.counters = {"chunks_written": 0, "chunk_bytes_written": 0, "chunks_renewed": 0,
                         "chunk_bytes_not_sent": 0, "chunks_lost": 0,  # (written by the writer threads)
                         "snapshots_superseded": 0}  # not written: Redis held a later version's copy
        self.dropped: dict[str, int] = dict.fromkeys(DROP_REASONS, 0)  # snapshots and deletes not sent, by why
        self._write_error_logged_at = float("-inf")
        self._down_until = 0.0
        self._usage = (0, 0)
        self._usage_at = float("-inf")
        self._redis = sync_client(url, cluster, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._lock = threading.Lock()
        self._queued = [threading.Condition(self._lock) for _ in range(WRITERS)]  # each writer waits on its own
        self._written = threading.Condition(self._lock)  # `wait_written` waits on it
        # Each writer's ops, in order (a key's ops go to one writer).
        self._ops: list[deque[_Op]] = [deque() for _ in range(WRITERS)]
        self._latest: OrderedDict[str, _Pending] = OrderedDict()  # session -> its newest snapshot, oldest first
        self._pending_bytes = 0
        self._deletes = 0  # deletes queued
        self._tickets = itertools.count()
        self._closing = False
        self._busy = [False] * WRITERS  # each writer: carrying out an op
        self._unwritten: set[str] = set()  # sessions with a snapshot queued or being written
        self._known: dict[str, float] = {}  # chunk -> when this tier last wrote or renewed it in Redis
        self._session_chunks: LRUCache[str, int] = LRUCache(CHUNKS_REMEMBERED)  # session -> chunks its last write named
        self._readers = ThreadPoolExecutor(READERS, thread_name_prefix="chatd-remote-read")
        self._writers = [threading.Thread(target=self._write_loop, args=(shard,), name=f"chatd-remote-kv-{shard}",
                                          daemon=True) for shard in range(WRITERS)]
        for writer in self._writers:
            writer.start()

    def probe(self) -> None:
        """Measure the Redis round trip and throughput once at start, so the first decision is not a guess (at
        start: the only call made on the caller's thread)."""
        key = f"chatd:probe:{id(self)}"
        payload = bytes(PROBE_BYTES)
        try:
            self._redis.ping()  # (connects: not part of a round trip)
            for _ in range(3):
                started = time.perf_counter()
                self._redis.ping()
                self.throughput.record_round_trip(time.perf_counter() - started)
            started = time.perf_counter()
            self._redis.set(key, payload, ex=60)
            self._redis.get(key)
            self.throughput.record(2 * PROBE_BYTES, time.perf_counter() - started)  # (two round trips: one counted)
            self._redis.delete(key)
        except UNREACHABLE:
            self._failed()
            log.warning("remote KV tier: Redis unreachable at start; turns recompute until it answers")
        except ResponseError as error:  # (a Redis at its maxmemory with nothing to evict: the worker starts anyway)
            log.warning("remote KV tier: Redis refused the start-up probe (%s); its throughput is not measured", error)

    @property
    def reachable(self) -> bool:
        """False for a while after a call found Redis unreachable: turns then skip this tier instead of waiting."""
        return time.monotonic() >= self._down_until

    def submit(self, job: Callable[[], T]) -> Future[T]:
        """Run `job` (a fetch: it calls `head` and `fetch`) on a reader thread."""
        return self._readers.submit(job)

    def chunks_known(self) -> int:
        with self._lock:
            return len(self._known)

    def pending(self) -> dict[str, int]:
        """Snapshots queued for writing and their bytes, deletes queued, and what was dropped (by why)."""
        with self._lock:
            return {"pending_writes": len(self._latest), "pending_bytes": self._pending_bytes,
                    "pending_deletes": self._deletes, **{f"dropped_{why}": n for why, n in self.dropped.items()}}

    def known_chunks(self, chunks: list[str]) -> int:
        """How many leading chunks of a run this tier wrote or renewed in Redis within half their retention, so that a
        snapshot need not carry them (every write renews the chunks it names; Redis may still have lost one, or
        another worker deleted one that failed its checks: the writer finds out and sends it again next time)."""
        deadline = time.monotonic() - self.ttl_s / 2
        with self._lock:
            count = 0
            for name in chunks:
                if self._known.get(name, float("-inf")) < deadline:
                    break
                count += 1
            return count

    def put(self, session_id: str, snapshot: RemoteSnapshot) -> None:
        """Queue a snapshot for writing; only the newest snapshot of a session is written. (A newer snapshot
        carries the bytes of every chunk an older one did: chunks are known held only once written.) Within the
        budget of queued bytes: the oldest queued snapshots are dropped for it (counted), or it is."""
        nbytes = snapshot.nbytes
        with self._lock:
            previous = self._latest.pop(session_id, None)
            if previous is not None:
                self._pending_bytes -= previous.nbytes
            while self._latest and self._pending_bytes + nbytes > self.pending_budget_bytes:
                self._drop_pending(next(iter(self._latest)), "full")
            if nbytes > self.pending_budget_bytes:
                self.dropped["full"] += 1
                self._settled(session_id)
                return
            ticket = previous.ticket if previous is not None else next(self._tickets)
            self._latest[session_id] = _Pending(snapshot, ticket, time.monotonic(), nbytes)
            self._pending_bytes += nbytes
            self._unwritten.add(session_id)
            if previous is None:
                self._queue_op(_Op("put", session_id, ticket))

    def wait_written(self, session_id: str, timeout_s: float) -> bool:
        """Wait until the session's newest snapshot has been written (or has failed, or was dropped); whether it was
        within `timeout_s`. A turn is answered after this, so that another worker can continue it from Redis."""
        with self._written:
            return self._written.wait_for(lambda: session_id not in self._unwritten, timeout_s)

    def drain(self, timeout_s: float) -> bool:
        """Wait until every queued write and delete has been carried out (or has failed); whether within
        `timeout_s`."""
        with self._written:
            return self._written.wait_for(lambda: not any(self._ops) and not any(self._busy), timeout_s)

    def head(self, session_id: str) -> RemoteHeader | None:
        """The session's header (a reader thread's call: one round trip, measured)."""
        if not self.reachable:
            return None
        try:
            started = time.perf_counter()
            raw = self._redis.get(redis_key(session_id, "kvmeta"))
            self.throughput.record_round_trip(time.perf_counter() - started)
        except UNREACHABLE:
            self._failed()
            return None
        if raw is None:
            return None
        try:
            return header_from(session_id, raw)
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("session %s: unreadable remote cache header; deleting it", session_id)
            self.delete(session_id, 0)  # (unless a readable one took its place meanwhile)
            return None

    def fetch(self, header: RemoteHeader, first: int = 0) -> RemoteCopy | None:
        """The session's token ids, tail and chunks from `first` on, in one round trip (a reader thread's call);
        None if its own bytes are gone (the header is then deleted) or Redis cannot be reached."""
        try:
            started = time.perf_counter()
            pipe = self._redis.pipeline(transaction=False)
            pipe.get(redis_key(header.session_id, "kv"))
            for name in header.chunks[first:]:
                pipe.get(chunk_key(name))
            blob, *chunks = pipe.execute()
            self.throughput.record(sum(len(b or b"") for b in (blob, *chunks)), time.perf_counter() - started)
        except UNREACHABLE:
            self._failed()
            return None
        if blob is None:
            log.warning("session %s: remote cache header without bytes; deleting it", header.session_id)
            self.delete(header.session_id, header.session_version)
            return None
        return copy_from(header, first, blob, chunks)

    def delete(self, session_id: str, up_to_version: int) -> None:
        """Queue the deletion of the session's own keys, if the copy Redis holds then is of at most `up_to_version`
        (the copy the caller found bad or of no use: never one written since); a snapshot of it still queued is not
        written, unless it is newer. Best effort: a header left behind is refused later by its version or
        fingerprint. Its chunks stay for the other sessions that start with them, until their retention runs out."""
        with self._lock:
            pending = self._latest.get(session_id)
            if pending is not None and pending.snapshot.session_version <= up_to_version:
                self._drop_pending(session_id)
            self._session_chunks.pop(session_id, None)
            self._queue_delete(_Op("delete", session_id, version=up_to_version))

    def delete_chunk(self, name: str) -> None:
        """A chunk failed its checks: queue its deletion from Redis, so that the next writer that has it sends it
        again."""
        with self._lock:
            self._known.pop(name, None)
            self._queue_delete(_Op("delete_chunk", name))

    def usage(self) -> tuple[int, int]:
        """Redis memory in use and its limit (`maxmemory`, or the machine's memory when unlimited; a cluster's:
        the sums over its primaries), as last read: a reader thread reads it again at most every few seconds. The
        remote tier shares that memory with sessions and leases."""
        now = time.monotonic()
        if now - self._usage_at >= USAGE_EVERY_S and self.reachable and not self._closing:
            self._usage_at = now
            self._readers.submit(self._read_usage)
        return self._usage

    def close(self) -> None:
        """Write what is queued (while Redis answers), then stop the threads."""
        with self._lock:
            self._closing = True
            for queued in self._queued:
                queued.notify()
        deadline = time.monotonic() + 30
        for writer in self._writers:
            writer.join(timeout=max(0.0, deadline - time.monotonic()))
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._redis.close()

    # ##### Helpers #####

    def _read_usage(self) -> None:
        try:
            if isinstance(self._redis, RedisCluster):
                nodes = list(self._redis.info("memory", target_nodes=RedisCluster.PRIMARIES).values())
            else:
                nodes = [self._redis.info("memory")]
        except UNREACHABLE:
            self._failed()
            return
        self._usage = (sum(int(info["used_memory"]) for info in nodes),
                       sum(int(info.get("maxmemory") or info.get("total_system_memory", 0)) for info in nodes))

    def _failed(self) -> None:
        with self._lock:
            self.errors += 1
        self._down_until = time.monotonic() + BACK_OFF_S
        log.warning("remote KV tier: Redis unreachable; skipping it for %.0f s", BACK_OFF_S)

    def _queue_delete(self, op: _Op) -> None:
        """(Under the lock.) Deletes are small; past `MAX_QUEUED_DELETES` they are dropped and counted (a copy left
        behind is refused by its checks, and expires)."""
        if self._deletes >= MAX_QUEUED_DELETES:
            self.dropped["deletes"] += 1
            return
        self._deletes += 1
        self._queue_op(op)

    def _queue_op(self, op: _Op) -> None:
        """(Under the lock.) A key's ops all go to one writer, in order; different keys' to several at once."""
        shard = xxhash.xxh3_64_intdigest(op.key.encode()) % WRITERS
        self._ops[shard].append(op)
        self._queued[shard].notify()

    def _drop_pending(self, session_id: str, reason: str | None = None) -> None:
        """(Under the lock.) Forget the session's queued snapshot (its queued op is skipped); `reason`: counted."""
        pending = self._latest.pop(session_id)
        self._pending_bytes -= pending.nbytes
        if reason is not None:
            self.dropped[reason] += 1
        self._settled(session_id)

    def _settled(self, session_id: str) -> None:
        """(Under the lock.) The session has no snapshot on its way: whoever waits for it is told."""
        if session_id not in self._latest:
            self._unwritten.discard(session_id)
            self._written.notify_all()

    def _next_op(self, shard: int) -> tuple[_Op, RemoteSnapshot | None] | None:
        """The next op of writer `shard` (a snapshot taken out of the queue), or None once closed with nothing
        left."""
        ops = self._ops[shard]
        with self._lock:
            self._busy[shard] = False
            while True:
                while not ops:
                    self._written.notify_all()  # (`drain` waits for this)
                    if self._closing:
                        return None
                    self._queued[shard].wait()
                op = ops.popleft()
                key = op.key
                if op.kind != "put":
                    self._deletes -= 1
                    self._busy[shard] = True
                    return op, None
                pending = self._latest.get(key)
                if pending is None or pending.ticket != op.ticket:
                    continue  # deleted or dropped since: a later op (if any) carries its newest snapshot
                del self._latest[key]
                self._pending_bytes -= pending.nbytes
                if time.monotonic() - pending.queued_at > self.pending_age_s:
                    self.dropped["expired"] += 1  # (its turn stopped waiting for it long ago)
                    self._settled(key)
                    continue
                self._busy[shard] = True
                return op, pending.snapshot

    def _write_loop(self, shard: int) -> None:
        """Carry out the queued ops, in order, until closed. No error ends the thread: a failed write (Redis
        unreachable, out of memory, refused) is counted and logged once per back-off, and the next op goes on."""
        while (next_op := self._next_op(shard)) is not None:
            (kind, key, _, version), snapshot = next_op
            try:
                if snapshot is not None:
                    self._write(key, snapshot)
                elif kind == "delete":
                    self._redis.eval(DELETE_SESSION, 2, redis_key(key, "kv"), redis_key(key, "kvmeta"), version)
                else:
                    self._redis.delete(chunk_key(key))
            except Exception as error:
                with self._lock:
                    self.write_errors += 1
                now = time.monotonic()
                if now >= self._write_error_logged_at + BACK_OFF_S:
                    self._write_error_logged_at = now
                    log.warning("remote KV tier: %s of %s failed (%s: %s); %d writes have failed so far, later ones "
                                "are still made", "writing the cache" if snapshot is not None else kind, key,
                                type(error).__name__, error, self.write_errors)
            finally:
                if snapshot is not None:
                    with self._lock:
                        self._settled(key)

    def _write(self, session_id: str, snapshot: RemoteSnapshot) -> None:
        """Write the snapshot (`write_snapshot`): in one round trip when its carried chunks all come after those the
        session's last written snapshot named, else asking Redis first which chunks it holds."""
        started = time.perf_counter()
        with self._lock:
            ahead = snapshot.start >= self._session_chunks.get(session_id, len(snapshot.chunks) + 1)
        sent, lost, counts = write_snapshot(self._redis, session_id, snapshot, ahead, self.chunk_tokens, self.ttl_s)
        self.throughput.record(sent, time.perf_counter() - started)
        self._written_run(session_id, snapshot.chunks, lost, counts)

    def _written_run(self, session_id: str, chunks: list[str], lost: list[str], counts: Counter[str]) -> None:
        """Remember the chunks a write left in Redis (all but those found `lost`), and the session's run length."""
        now = time.monotonic()
        with self._lock:
            for name, count in counts.items():
                self.counters[name] += count
            if len(self._known) >= CHUNKS_REMEMBERED:  # the oldest have expired or soon will
                for old in sorted(self._known, key=self._known.get)[:CHUNKS_REMEMBERED // 2]:
                    del self._known[old]
            for name in chunks:
                self._known[name] = now
            for name in lost:
                self._known.pop(name, None)
                self.counters["chunks_lost"] += 1
            self._session_chunks[session_id] = len(chunks)
