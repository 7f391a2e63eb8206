"""Moving caches between tiers, checked both ways: an evicted cache offloaded to the host tier (exact or
int8; a shared segment once, exact), a host or Redis copy checked and restored onto the device, starting with
the shared segment it names (resident, or restored first), so that a segment is never copied twice.

Part of the cache store (`CacheStore` decides what moves; this does the moving), in the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Literal, Protocol

import torch

import cache_store.chain as chain
from cache_store.arena import ArenaCache, ArenaFull
from cache_store.cost_model import CostModel, RemoteDecision
from cache_store.device_tier import DeviceTier
from cache_store.entry import CacheEntry, NewCache
from cache_store.host_tier import HostTier
from cache_store.identity import CacheLayout
from cache_store.integrity import Check, check_finite, check_identity, check_scales, check_tensors, checksum
from cache_store.lookup import CopyObserver, RemoteCaches
from cache_store.offload import HostEntry, Offloader, host_nbytes
from cache_store.quantize import GROUP_TOKENS, KVDtype
from cache_store.remote_tier import RemoteHeader
from cache_store.segments import SharedSegments, is_segment
from cache_store.stage_faults import FaultPoints

log = logging.getLogger(__name__)
# A chain of host copies is restored copy by copy (each checked, each copied into place): past this many, an
# offload writes the whole cache again, so that a restore stays as fast as a single copy's (docs/benchmarks.md).
MAX_HOST_COPIES = 4


class TierOwner(Protocol):
    """What the moves need of the cache store they work for (`CacheStore`)."""

    device: DeviceTier
    host: HostTier
    segments: SharedSegments
    offloader: Offloader
    new_cache: NewCache
    layout: CacheLayout
    model_key: str
    host_kv_dtype: KVDtype
    faults: FaultPoints
    counters: Counter[str]
    connected: set[str]
    cost: CostModel
    remote: RemoteCaches | None
    on_copy: CopyObserver

    def make_room(self, need_bytes: int, keep: str | Sequence[str] = ()) -> None: ...

    def remember_loss(self, session_id: str) -> None: ...

    def report_corruption(self, session_id: str, failed: tuple[Check, ...]) -> object: ...

    def drop(self, session_id: str) -> None: ...


class TierMoves:
    """Offload, restore and remote fetches for one cache store."""

    def __init__(self, store: TierOwner):
        self.store = store

    def find_segment(self, key: str, token_ids: list[int]) -> CacheEntry | None:
        """The segment `key` holding exactly `token_ids`: on the device (checked), or brought back from the host
        tier (checked); a segment that fails a check is dropped with what starts with it."""
        store = self.store
        segment, failed = store.segments.find(key, token_ids)
        held = store.host.get(key)
        if segment is None and not failed and held is not None and held.token_ids == token_ids[:len(held.token_ids)]:
            segment, failed = self.restore(key)
        if failed:
            store.report_corruption(key, failed)
        return segment

    def from_remote(self, session_id: str, header: RemoteHeader, segment: CacheEntry | None
                     ) -> tuple[CacheEntry | None, RemoteDecision, tuple[Check, ...]]:
        """The session's cache from the remote tier, when fetching it is estimated to be faster than
        recomputing it; it passes every restore check before use. A copy that names the shared segment it
        starts with continues that segment, found here (device or host) or fetched once from Redis (the cost
        counts only what is fetched). A whole copy whose first positions `segment` (resident) holds starts
        with it, and only the positions after it are copied onto the device."""
        store = self.store
        fetched_segment = None
        if header.prefix_key is not None and header.prefix_key not in store.device \
                and header.prefix_key not in store.host:
            fetched_segment = store.remote.head(header.prefix_key)
            if fetched_segment is None:  # gone from Redis: the copy cannot be continued
                store.remote.delete(session_id)
                return None, RemoteDecision("recompute", None, None), ()
        decision = store.cost.decide(header.nbytes + (fetched_segment.nbytes if fetched_segment else 0),
                                     header.fingerprint.num_tokens)
        if decision.choice == "recompute":
            return None, decision, ()
        started = time.perf_counter()
        host_entry = store.remote.fetch(header)
        if host_entry is None:
            return None, decision, ()
        if failed := self.check_host_entry(session_id, host_entry):
            return None, decision, failed
        if header.prefix_key is not None:
            segment, failed = self._remote_segment(header.prefix_key, host_entry, fetched_segment)
            if failed or segment is None:
                return None, decision, failed
        elif segment is not None and host_entry.token_ids[:segment.num_tokens] == segment.token_ids and \
                segment.num_tokens % GROUP_TOKENS == 0:  # (a segment is whole units: always on a key group's edge)
            skip, groups = segment.num_tokens, segment.num_tokens // GROUP_TOKENS
            host_entry = dataclasses.replace(
                host_entry, tensors=[(k[..., skip:, :], v[..., skip:, :]) for k, v in host_entry.tensors],
                scales=None if host_entry.scales is None else [(ks[..., groups:, :], vs[..., skip:, :])
                                                               for ks, vs in host_entry.scales],
                prefix_key=segment.cache.segment_key, prefix_tokens=skip)
        else:
            segment = None
        entry = self.adopt(session_id, host_entry, "remote", started, segment)
        store.counters["remote_restores"] += 1
        return entry, decision, ()

    def _remote_segment(self, key: str, host_entry: HostEntry, header: RemoteHeader | None
                        ) -> tuple[CacheEntry | None, tuple[Check, ...]]:
        """The shared segment a remote copy starts with: here (device or host, checked), or else fetched from
        Redis (`header`, when already read) and checked like any cache; one that fails is cleared everywhere,
        so every cache that starts with it recomputes. None without a failure when it is gone or holds other
        positions."""
        store = self.store
        ids = host_entry.token_ids[:host_entry.prefix_tokens]
        segment = self.find_segment(key, ids) if header is None else None
        if segment is None:
            header = header or store.remote.head(key)
            segment_copy = store.remote.fetch(header) if header is not None else None
            if segment_copy is None:
                return None, ()
            if failed := self.check_host_entry(key, segment_copy):
                log.warning("shared segment %s from Redis failed the %s check; cleared", key, ", ".join(failed))
                store.drop(key)  # (counted once, as the session's corruption, by the caller)
                store.remote.delete(key)
                return None, failed
            segment = self.adopt(key, segment_copy, "remote", time.perf_counter())
            segment.cache.frozen, segment.cache.segment_key = True, key
            store.counters["remote_segment_restores"] += 1
        if segment.token_ids != ids:
            return None, ()
        return segment, ()

    def restore(self, key: str) -> tuple[CacheEntry | None, tuple[Check, ...]]:
        """Bring a host entry (a session's, or a shared segment's) back to the device once it passes every
        check, starting with the segment it names (resident, or restored first); else report what failed. None
        without a failure when that segment is gone: the entry is dropped and its turn recomputes. A chain of
        copies whose later copy fails is restored up to its last good copy (with the failure: the turn
        recomputes only the rest)."""
        store = self.store
        started = time.perf_counter()
        # First: making room offloads others into the host tier. A segment never changes, so its host copy stays
        # there: when the device lets it go again, nothing is copied.
        host_entry = store.host.get(key) if is_segment(key) else store.host.pop(key)
        good, failed = self._last_good(key, host_entry)
        if good is None:
            store.host.discard(key) if is_segment(key) else store.host.release(host_entry)
            return None, failed
        if failed:
            log.warning("session %s: a host copy of its cache failed the %s check; restoring the copies before it",
                        key, ", ".join(failed))
            store.host.release_after(host_entry, good)
            host_entry = good
        segment = None
        if host_entry.prefix_key is not None:
            segment = self.find_segment(host_entry.prefix_key, host_entry.token_ids[:host_entry.prefix_tokens])
            if segment is None or segment.num_tokens != host_entry.prefix_tokens:
                store.host.release(host_entry)
                store.remember_loss(key)
                return None, ()
        try:
            entry = self.adopt(key, host_entry, "host", started, segment)
        except ArenaFull:
            if not is_segment(key):
                store.host.put(key, host_entry)  # kept where it was, for when there is room
            raise
        if is_segment(key):
            entry.cache.frozen, entry.cache.segment_key = True, key
            store.host.touch(key)
        else:  # kept, first to go: the session's next offload copies only what its turns add to it
            store.host.put(key, host_entry, first_to_go=True)
        store.counters["segment_restores" if is_segment(key) else "restores"] += 1
        return entry, failed

    def _last_good(self, owner: str, host_entry: HostEntry) -> tuple[HostEntry | None, tuple[Check, ...]]:
        """The newest copy of the chain whose copies all pass every check (None: not even the first), and the
        failure of the copy after it."""
        good = None
        for piece in host_entry.pieces():
            if failed := self._check_piece(owner, piece):
                return good, (failed,)
            good = piece
        return good, ()

    def check_host_entry(self, owner: str, host_entry: HostEntry) -> tuple[Check, ...]:
        """Identity, shapes, the checksum of every stored byte (scales included), values finite (for a
        quantised entry: its scales, since int8 cannot be NaN); for each copy it continues too."""
        for piece in host_entry.pieces():
            if failed := self._check_piece(owner, piece):
                return (failed,)
        return ()

    def _check_piece(self, owner: str, host_entry: HostEntry) -> Check | None:
        store = self.store
        tokens, quantized = host_entry.own_tokens, host_entry.scales is not None
        stored_layout = dataclasses.replace(store.layout, dtype=torch.int8) if quantized else store.layout
        return (check_identity(host_entry.fingerprint, store.model_key, owner, host_entry.token_ids, store.layout)
                or (quantized and host_entry.fingerprint.quantized != "int8" and "fingerprint")
                or check_tensors(host_entry.tensors, tokens, stored_layout)
                or (quantized and check_scales(host_entry.scales, tokens, store.layout))
                or (checksum(host_entry.stored) != host_entry.checksum and "checksum")
                or check_finite(host_entry.scales if quantized else host_entry.tensors))

    def adopt(self, session_id: str, host_entry: HostEntry, tier: Literal["host", "remote"],
               started: float, segment: CacheEntry | None = None) -> CacheEntry:
        """Put a checked host entry back on the device, starting with `segment` when it names one. Its restore
        time, observed from `started`, counts the fetch, the checks and the copy, not the evictions that made
        room for it."""
        store = self.store
        fetched_s = time.perf_counter() - started
        if host_entry.device_nbytes <= store.device.budget_bytes:  # else it is restored outside the arena
            # (the segments it will start with stay: nothing starts with them until it does)
            keep = [session_id, *(s.segment_key for s in chain.segments(segment.cache) + [segment.cache])] \
                if segment is not None else [session_id]
            store.make_room(store.device.extra_bytes(session_id, host_entry.device_nbytes), keep=keep)
        copy_started = time.perf_counter()
        entry, copied = store.offloader.restore(host_entry, store.new_cache, segment.cache if segment else None)
        for piece in host_entry.pieces():  # (a host copy stays: see `restore`)
            piece.restoring = copied
        # The checksum verified on the host is the device's when both are read the same way (on a CPU, at
        # full precision, one copy); a GPU reads the device copy with its own kind, and a dequantised copy or a
        # chain of copies is new bytes.
        same_bytes = entry.tensors()[0][0].device.type == "cpu" and host_entry.scales is None \
            and host_entry.base is None
        remote_sliced = tier == "remote" and segment is not None
        entry.checksum = host_entry.checksum if same_bytes and not remote_sliced else checksum(entry.tensors())
        store.device.put(session_id, entry, connected=session_id in store.connected)
        store.on_copy("restore", tier, fetched_s + time.perf_counter() - copy_started)
        return entry

    def offload(self, session_id: str) -> None:
        """Move a device cache to the host tier, whose oldest entries make room; a cache that does not
        fit there, or whose offload fails, is lost (its next turn recomputes) and nothing else fails."""
        store = self.store
        entry = store.device.pop(session_id)
        store.counters["segment_offloads" if is_segment(session_id) else "device_evictions"] += 1
        kv_dtype = "same" if is_segment(session_id) else store.host_kv_dtype  # a segment is held once: exact
        base = None if is_segment(session_id) else store.host.pop(session_id)  # kept from its restore
        if base is not None and (len(base.pieces()) >= MAX_HOST_COPIES or not _continued_by(base, entry, kv_dtype)):
            store.host.release(base)
            base = None
        start = len(base.token_ids) - entry.prefix_tokens if base is not None else 0
        started = time.perf_counter()
        if base is not None and start == entry.own_tokens:  # nothing added since it was restored
            store.host.put(session_id, base)
            store.counters["host_offload_bytes_skipped"] += _stored_bytes(base)
            store.on_copy("offload", "host", time.perf_counter() - started)
            return
        buffer = None
        try:
            store.faults.check("offload", session_id)
            need = host_nbytes(entry, kv_dtype, start)
            dropped, fits = store.host.make_room(need)
            for key in dropped:
                store.remember_loss(key)
                store.counters["host_evictions"] += 1
            if not fits:
                if base is not None:
                    store.host.release(base)
                store.remember_loss(session_id)
                store.counters["host_evictions"] += 1
                return
            buffer = store.host.pool.take(need)
            host_entry = store.offloader.offload(entry, buffer, kv_dtype, base=base)
        except Exception:
            log.exception("offloading session %s's cache failed; it is dropped and its next turn recomputes",
                          session_id)
            if buffer is not None:
                store.host.pool.give(buffer)
            if base is not None:
                store.host.release(base)
            store.faults.disarm(session_id)
            store.counters["offload_failures"] += 1
            store.drop(session_id)
            store.remember_loss(session_id)
            return
        store.on_copy("offload", "host", time.perf_counter() - started)
        store.counters["host_offload_bytes"] += need
        store.counters["host_offload_bytes_skipped"] += _stored_bytes(base) if base is not None else 0
        if not _left_intact(entry, host_entry):  # changed while resident: never launder it into the host tier
            store.host.release(host_entry)
            store.report_corruption(session_id, ("checksum",))
            return
        store.host.put(session_id, host_entry)


def _stored_bytes(entry: HostEntry) -> int:
    """The host bytes of a chain of copies: what an offload that continues it did not write again."""
    return sum(piece.nbytes for piece in entry.pieces())


def _continued_by(base: HostEntry, entry: CacheEntry, kv_dtype: KVDtype) -> bool:
    """Whether `entry` (resident) continues the host copy `base` it was restored from: the same owner, segment,
    first positions and storage, so that an offload may copy only the positions after it."""
    prefix = entry.cache.prefix if isinstance(entry.cache, ArenaCache) else None
    return (base.fingerprint is not None and entry.fingerprint is not None
            and base.fingerprint.owner == entry.fingerprint.owner
            and base.prefix_key == (prefix.segment_key if prefix is not None else None)
            and base.prefix_tokens == entry.prefix_tokens and len(base.token_ids) <= entry.num_tokens
            and entry.token_ids[:len(base.token_ids)] == base.token_ids
            and all((piece.scales is not None) == (kv_dtype == "int8") for piece in base.pieces()))


def _left_intact(entry: CacheEntry, host_entry: HostEntry) -> bool:
    """Whether the cache reached the host with the bytes it was written back with."""
    if entry.checksum is None:
        return True
    if host_entry.base is None and host_entry.scales is None and \
            entry.checksum.split(":")[0] == host_entry.checksum.split(":")[0]:
        return host_entry.checksum == entry.checksum  # read the same way: the copy's checksum says it
    return checksum(entry.tensors()) == entry.checksum
