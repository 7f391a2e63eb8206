"""Caches serialized to Redis, shared by every worker: a session can move to another worker (or
survive a restart) without recomputing its history, when fetching is cheaper than recomputing.

Each cache is two keys with one TTL: `chatd:{id}:kv` holds the bytes (the token ids as int32, then
every layer's keys and values), `chatd:{id}:kvmeta` a JSON header (format version, fingerprint,
session version, shapes, dtype, checksum). The bytes are written before the header, so a reader
that finds a header finds its bytes unless they expired; a header whose bytes are gone is deleted
and counts as a miss. Writes happen on a background thread, latest snapshot first.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import queue
import threading
import time
from dataclasses import dataclass

import redis
import torch

from cache_store.cost_model import Throughput
from cache_store.identity import CacheLayout, Fingerprint
from cache_store.offload import HostEntry
from sessions.encoding import UNREACHABLE, pack_ids, redis_key, unpack_ids

log = logging.getLogger(__name__)

# 2: checksums carry their kind (xxh3:…); 3: int8 caches with their scales; 4: key scales per group; 5: a cache may
# hold only its own positions, naming the shared segment it starts with (stored once, under the segment's key)
FORMAT_VERSION = 5
PROBE_BYTES = 4 * 2**20
BACK_OFF_S = 5.0  # after a failure, turns skip the remote tier this long instead of waiting on Redis
USAGE_EVERY_S = 5.0
SEGMENTS_REMEMBERED = 10_000  # shared segments this tier remembers writing (beyond: it may write one again)


@dataclass(frozen=True)
class RemoteHeader:
    """What Redis says about a session's cache before its bytes are fetched."""

    session_id: str
    fingerprint: Fingerprint
    session_version: int
    shapes: list[list[int]]
    dtype: torch.dtype
    checksum: str
    nbytes: int
    scale_shapes: list[list[int]]  # of a quantised cache's float32 scales (after its int8 tensors), or none
    prefix_key: str | None = None  # the shared segment its first positions are in (its tensors hold the rest)
    prefix_tokens: int = 0  # that segment's positions


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))


class RemoteTier:
    """Caches in Redis, written in the background, shared by every worker."""

    def __init__(self, url: str, ttl_s: float, timeout_s: float = 1.0):
        self.ttl_s = int(ttl_s)
        self.throughput = Throughput()
        self.errors = 0  # reads that failed
        self.write_errors = 0  # snapshots that could not be written
        self._write_error_logged_at = float("-inf")
        self._down_until = 0.0
        self._usage = (0, 0)
        self._usage_at = float("-inf")
        self._redis = redis.Redis.from_url(url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._writes: queue.Queue[str | None] = queue.Queue()
        self._latest: dict[str, HostEntry] = {}
        self._lock = threading.Lock()
        self._unwritten: set[str] = set()  # sessions with a snapshot queued or being written
        self._segments_written: dict[str, float] = {}  # shared segment -> when this tier last wrote it
        self._written = threading.Condition(self._lock)
        self._writer = threading.Thread(target=self._write_loop, name="chatd-remote-kv", daemon=True)
        self._writer.start()

    def probe(self) -> None:
        """Measure the Redis throughput once at start, so the first decision is not a guess."""
        key = f"chatd:probe:{id(self)}"
        payload = bytes(PROBE_BYTES)
        try:
            started = time.perf_counter()
            self._redis.set(key, payload, ex=60)
            self._redis.get(key)
            self.throughput.record(2 * PROBE_BYTES, time.perf_counter() - started)
            self._redis.delete(key)
        except UNREACHABLE:
            self.errors += 1

    def put_segment(self, key: str, entry: HostEntry) -> None:
        """Queue a shared segment's copy, remembered as written (see `holds_segment`)."""
        with self._lock:
            if len(self._segments_written) >= SEGMENTS_REMEMBERED:  # the oldest have expired or soon will
                for old in sorted(self._segments_written, key=self._segments_written.get)[:SEGMENTS_REMEMBERED // 2]:
                    del self._segments_written[old]
            self._segments_written[key] = time.monotonic()
        self.put(key, entry)

    def holds_segment(self, key: str) -> bool:
        """Whether this tier wrote the segment within half its retention, so that it need not be written again
        (a segment never changes, and the caches that start with it renew its retention as they are written;
        unless Redis lost it, or another worker deleted a copy that failed its checks)."""
        with self._lock:
            return time.monotonic() < self._segments_written.get(key, float("-inf")) + self.ttl_s / 2

    def put(self, session_id: str, entry: HostEntry) -> None:
        """Queue a snapshot for writing; only the newest snapshot of a session is written."""
        with self._lock:
            fresh = session_id not in self._latest
            self._latest[session_id] = entry
            self._unwritten.add(session_id)
        if fresh:
            self._writes.put(session_id)

    def wait_written(self, session_id: str, timeout_s: float) -> bool:
        """Wait until the session's newest snapshot has been written (or has failed); whether it was within
        `timeout_s`. A turn is answered after this, so that another worker can continue it from Redis."""
        with self._written:
            return self._written.wait_for(lambda: session_id not in self._unwritten, timeout_s)

    def head(self, session_id: str) -> RemoteHeader | None:
        if time.monotonic() < self._down_until:
            return None
        try:
            raw = self._redis.get(redis_key(session_id, "kvmeta"))
        except UNREACHABLE:
            self._failed()
            return None
        if raw is None:
            return None
        try:
            meta = json.loads(raw)
            if meta["format"] != FORMAT_VERSION:
                return None
            stamp = meta["fingerprint"]
            layout = CacheLayout(**{**stamp["layout"], "dtype": _dtype(stamp["layout"]["dtype"])})
            return RemoteHeader(session_id, Fingerprint(**{**stamp, "layout": layout}), meta["session_version"],
                                meta["shapes"], _dtype(meta["dtype"]), meta["checksum"], meta["nbytes"],
                                meta["scale_shapes"], meta["prefix_key"], meta["prefix_tokens"])
        except (KeyError, TypeError, ValueError, AttributeError):
            log.warning("session %s: unreadable remote cache header; deleting it", session_id)
            self.delete(session_id)
            return None

    def fetch(self, header: RemoteHeader) -> HostEntry | None:
        """The cache behind `header`, or None if its bytes are gone (the header is then deleted)."""
        try:
            started = time.perf_counter()
            blob = self._redis.get(redis_key(header.session_id, "kv"))
            self.throughput.record(len(blob or b""), time.perf_counter() - started)
        except UNREACHABLE:
            self._failed()
            return None
        if blob is None:
            log.warning("session %s: remote cache header without bytes; deleting it", header.session_id)
            self.delete(header.session_id)
            return None
        return _deserialize(header, blob)

    def delete(self, session_id: str) -> None:
        """Best effort: a header left behind is refused later by its version or fingerprint."""
        with self._lock:
            self._segments_written.pop(session_id, None)
        if time.monotonic() < self._down_until:
            return
        try:
            self._redis.delete(redis_key(session_id, "kvmeta"), redis_key(session_id, "kv"))
        except UNREACHABLE:
            self._failed()

    def usage(self) -> tuple[int, int]:
        """Redis memory in use and its limit (`maxmemory`, or the machine's memory when unlimited),
        read at most every few seconds. The remote tier shares that memory with sessions and leases."""
        now = time.monotonic()
        if now - self._usage_at < USAGE_EVERY_S or now < self._down_until:
            return self._usage
        self._usage_at = now
        try:
            info = self._redis.info("memory")
        except UNREACHABLE:
            self._failed()
            return self._usage
        self._usage = (int(info["used_memory"]), int(info.get("maxmemory") or info.get("total_system_memory", 0)))
        return self._usage

    def _failed(self) -> None:
        self.errors += 1
        self._down_until = time.monotonic() + BACK_OFF_S
        log.warning("remote KV tier: Redis unreachable; skipping it for %.0f s", BACK_OFF_S)

    def close(self) -> None:
        self._writes.put(None)
        self._writer.join(timeout=30)
        self._redis.close()

    def _write_loop(self) -> None:
        """Write snapshots until closed. No error ends the thread: a failed write (Redis unreachable,
        out of memory, refused) is counted and logged once per back-off, and the next snapshot goes on."""
        while (session_id := self._writes.get()) is not None:
            with self._lock:
                entry = self._latest.pop(session_id)
            try:
                self._write(session_id, entry)
            except Exception as error:
                self.write_errors += 1
                now = time.monotonic()
                if now >= self._write_error_logged_at + BACK_OFF_S:
                    self._write_error_logged_at = now
                    log.warning("remote KV tier: writing session %s's cache failed (%s: %s); %d writes have "
                                "failed so far, later snapshots are still written", session_id,
                                type(error).__name__, error, self.write_errors)
            finally:
                with self._written:
                    if session_id not in self._latest:  # no newer snapshot queued meanwhile
                        self._unwritten.discard(session_id)
                        self._written.notify_all()

    def _write(self, session_id: str, entry: HostEntry) -> None:
        tensors = [t for pair in entry.tensors for t in pair]
        scales = [t for pair in entry.scales or [] for t in pair]
        blob = pack_ids(entry.token_ids) + b"".join(
            t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors + scales)
        stamp = dataclasses.asdict(entry.fingerprint)
        stamp["layout"]["dtype"] = str(entry.fingerprint.layout.dtype)
        meta = {"format": FORMAT_VERSION, "fingerprint": stamp, "session_version": entry.session_version,
                "shapes": [list(t.shape) for t in tensors], "dtype": str(tensors[0].dtype),
                "scale_shapes": [list(t.shape) for t in scales], "checksum": entry.checksum, "nbytes": len(blob),
                "prefix_key": entry.prefix_key, "prefix_tokens": entry.prefix_tokens}
        started = time.perf_counter()
        self._redis.set(redis_key(session_id, "kv"), blob, ex=self.ttl_s)  # bytes first, then the header
        self._redis.set(redis_key(session_id, "kvmeta"), json.dumps(meta), ex=self.ttl_s)
        if entry.prefix_key is not None:  # the segment lives as long as a cache that starts with it
            for part in ("kv", "kvmeta"):
                self._redis.expire(redis_key(entry.prefix_key, part), self.ttl_s)
        self.throughput.record(len(blob), time.perf_counter() - started)


def _deserialize(header: RemoteHeader, blob: bytes) -> HostEntry:
    """Split the blob back into token ids and tensors as the header describes them; a blob shorter or
    longer than that still yields tensors, for the checks to refuse."""
    num_tokens = header.fingerprint.num_tokens
    ids = unpack_ids(blob[:4 * num_tokens])
    data = torch.frombuffer(bytearray(blob[4 * num_tokens:]), dtype=torch.uint8)
    tensors, offset = _tensors(data, 0, header.shapes, header.dtype)
    scales, _ = _tensors(data, offset, header.scale_shapes, torch.float32)
    return HostEntry(_pairs(tensors), ids, header.fingerprint, header.checksum, header.session_version,
                     scales=_pairs(scales) if header.scale_shapes else None, prefix_key=header.prefix_key,
                     prefix_tokens=header.prefix_tokens)


def _tensors(data: torch.Tensor, offset: int, shapes: list[list[int]], dtype: torch.dtype
             ) -> tuple[list[torch.Tensor], int]:
    """Tensors of `shapes` read from `data` at `offset`, and the offset after them; a short blob still
    yields tensors, cut in a shape the checks refuse."""
    element, tensors = dtype.itemsize, []
    for shape in shapes:
        size = element * int(torch.Size(shape).numel())
        chunk = data[offset:offset + size]
        if chunk.numel() < size:  # truncated: keep what is there, in a shape the checks will refuse
            per_token = element * shape[1] * shape[3]
            shape = [1, shape[1], chunk.numel() // per_token, shape[3]]
            chunk = chunk[:element * int(torch.Size(shape).numel())]
        tensors.append(chunk.view(dtype).reshape(shape))
        offset += size
    return tensors, offset


def _pairs(tensors: list[torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return list(zip(tensors[0::2], tensors[1::2], strict=True))
