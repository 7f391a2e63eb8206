"""Moving caches between the device and the host tier, checked both ways: an evicted cache offloaded (exact or
int8; a shared segment once, exact; a session's continuing the copy of its system prompt its owner's sessions
share, or its own chain), a host copy checked and restored onto the device, starting with the shared segment it
names (resident, or restored first), so that a segment is never copied twice. (Redis: `remote_moves.py`.)

Part of the cache store (`CacheStore` decides what moves; this does the moving), in the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Protocol

import torch

import cache_store.chain as chain
from cache_store.arena import ArenaCache
from cache_store.chunks import CHUNK_TOKENS, chain_hashes, chunk_identity
from cache_store.device_tier import DeviceTier
from cache_store.entry import CacheEntry, NewCache
from cache_store.failure_log import log_failure
from cache_store.host_tier import HostTier
from cache_store.identity import CacheLayout
from cache_store.integrity import (
    Check,
    check_finite,
    check_identity,
    check_scales,
    check_tensors,
    checksum,
    fingerprint,
    token_digest,
)
from cache_store.lookup import CopyObserver
from cache_store.offload import HostEntry, Offloader, host_nbytes
from cache_store.quantize import KVDtype
from cache_store.segments import SharedSegments, is_segment
from cache_store.stage_faults import FaultPoints

log = logging.getLogger(__name__)
# A chain of host copies is restored copy by copy (each checked, each copied into place): past this many, an
# offload copies again all that follows the system prompt's named copy, so that a restore stays fast
# (docs/benchmarks.md).
MAX_HOST_COPIES = 5


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
    on_copy: CopyObserver

    def make_room(self, need_bytes: int, keep: str | Sequence[str] = ()) -> None: ...

    def remember_loss(self, session_id: str) -> None: ...

    def scope_of(self, session_id: str) -> str: ...

    def prompt_tokens(self, session_id: str) -> int: ...

    def report_corruption(self, session_id: str, failed: tuple[Check, ...]) -> object: ...

    def drop(self, session_id: str) -> None: ...


class TierMoves:
    """Offload and restore for one cache store."""

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

    def restore(self, key: str, for_turn: bool = False) -> tuple[CacheEntry | None, tuple[Check, ...]]:
        """Bring a host entry (a session's, or a shared segment's) back to the device once it passes every
        check, starting with the segment it names (resident, or restored first); else report what failed. None
        without a failure when that segment is gone: the entry is dropped and its turn recomputes. A chain of
        copies whose later copy fails is restored up to its last good copy (with the failure: the turn
        recomputes only the rest). `for_turn`: handed to a turn at once, which changes it (and its write-back
        takes its checksum), so none is taken now."""
        store = self.store
        started = time.perf_counter()
        if is_segment(key):  # A segment never changes: its host copy stays, so letting it go again copies nothing.
            entry, failed, _ = self._bring_back(key, store.host.get(key), started)
            if entry is None and failed:
                store.host.discard(key)
            elif entry is not None:
                entry.cache.frozen, entry.cache.segment_key = True, key
                store.host.touch(key)
                store.counters["segment_restores"] += 1
            return entry, failed
        chain = store.host.take(key)  # (ours while it is read: room made meanwhile never drops a copy of it)
        try:
            entry, failed, kept = self._bring_back(key, chain, started, stamp=not for_turn)
            if entry is not None:
                store.host.put(key, kept, first_to_go=True)  # the session's next offload continues it
        except BaseException:  # no room (ArenaFull), or a copy that failed: the host copy is as it was
            store.host.put(key, chain)  # kept where it was, for when there is room
            raise
        finally:
            store.host.release(chain)  # (what the tier keeps of it stays)
        if entry is None:
            return None, failed
        store.counters["restores"] += 1
        return entry, failed

    def _bring_back(self, key: str, chain: HostEntry, started: float, stamp: bool = True
                    ) -> tuple[CacheEntry | None, tuple[Check, ...], HostEntry | None]:
        """`restore`'s checks and copy: the device entry, the failed check, and the copy of the chain it was
        restored up to."""
        store = self.store
        good, failed = self._last_good(key, chain)
        if failed:  # no later offload continues the copy that failed (every chain that includes it checks it too)
            pieces = chain.pieces()
            store.host.forget(pieces[next(i + 1 for i, piece in enumerate(pieces) if piece is good)
                                     if good is not None else 0])
        if good is None:
            return None, failed, None
        if failed:
            log.warning("session %s: a host copy of its cache failed the %s check; restoring the copies before it",
                        key, ", ".join(failed))
        segment = None
        if good.prefix_key is not None:
            segment = self.find_segment(good.prefix_key, good.token_ids[:good.prefix_tokens])
            if segment is None or segment.num_tokens != good.prefix_tokens:
                store.remember_loss(key)
                return None, (), None
        entry = self.adopt(key, good, started, segment, stamp)
        if good.name is not None:  # (a named copy's fingerprint is its owner's: the cache is the session's)
            entry.fingerprint = fingerprint(entry, store.model_key, key, store.layout)
        return entry, failed, good

    def _last_good(self, owner: str, host_entry: HostEntry) -> tuple[HostEntry | None, tuple[Check, ...]]:
        """The newest copy of the chain whose copies all pass every check (None: not even the first), and the
        failure of the copy after it."""
        good = None
        for piece in host_entry.pieces():
            if failed := self._check_piece(owner, piece):
                return good, (failed,)
            good = piece
        return good, ()

    def _check_piece(self, owner: str, host_entry: HostEntry) -> Check | None:
        """Every check of one copy of a chain; a named copy belongs to the owner whose chunks it holds, which must
        be `owner`'s."""
        store = self.store
        if host_entry.name is not None:
            if host_entry.scope not in (store.scope_of(owner), f"session:{owner}"):  # (the latter: its own alone)
                return "fingerprint"
            owner = host_entry.scope
        tokens, quantized = host_entry.own_tokens, host_entry.scales is not None
        stored_layout = dataclasses.replace(store.layout, dtype=torch.int8) if quantized else store.layout
        return (check_identity(host_entry.fingerprint, store.model_key, owner, host_entry.token_ids, store.layout)
                or (quantized and host_entry.fingerprint.quantized != "int8" and "fingerprint")
                or check_tensors(host_entry.tensors, tokens, stored_layout)
                or (quantized and check_scales(host_entry.scales, tokens, store.layout))
                or (checksum(host_entry.stored) != host_entry.checksum and "checksum")
                or check_finite(host_entry.scales if quantized else host_entry.tensors))

    def _segment_needed(self, key: str) -> bool:
        """Whether a shared segment's host copy is needed: a host copy of a session's cache starts with it (one
        still on the device keeps its own; a new session finds it on the device, or recomputes it)."""
        host = self.store.host
        return any(host.get(other).prefix_key == key for other in host.keys())

    def adopt(self, session_id: str, host_entry: HostEntry, started: float, segment: CacheEntry | None = None,
              stamp: bool = True) -> CacheEntry:
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
        store.faults.check("restore", session_id)  # (a copy that fails once it has begun, for tests and drills)
        # The checksum verified on the host is the device's when both are read the same way (on a CPU, at
        # full precision, one copy); a GPU reads the device copy with its own kind, and a dequantised copy or a
        # chain of copies is new bytes.
        same_bytes = entry.tensors()[0][0].device.type == "cpu" and host_entry.scales is None \
            and host_entry.base is None
        entry.checksum = host_entry.checksum if same_bytes else checksum(entry.tensors()) if stamp else None
        store.device.put(session_id, entry, connected=session_id in store.connected)
        store.on_copy("restore", "host", fetched_s + time.perf_counter() - copy_started)
        return entry

    def offload(self, session_id: str) -> None:
        """Move a device cache to the host tier, whose oldest entries make room; a cache that does not
        fit there, or whose offload fails, is lost (its next turn recomputes) and nothing else fails. A session's
        cache continues its own chain (kept since its restore) or the copy of its system prompt's chunks its
        owner's sessions share (named, held once): only the positions after it are copied (`offload_base`)."""
        store = self.store
        entry = store.device.pop(session_id)
        store.counters["segment_offloads" if is_segment(session_id) else "device_evictions"] += 1
        kv_dtype = "same" if is_segment(session_id) else store.host_kv_dtype  # a segment is held once: exact
        kept = None if is_segment(session_id) else store.host.take(session_id)  # kept from its restore: ours
        started = time.perf_counter()
        if kept is not None and len(kept.token_ids) == entry.num_tokens and _continued_by(kept, entry, kv_dtype):
            store.host.put(session_id, kept)  # nothing added since it was restored
            store.host.release(kept)
            store.counters["host_offload_bytes_skipped"] += _stored_bytes(kept)
            store.on_copy("offload", "host", time.perf_counter() - started)
            return
        scope = store.scope_of(session_id)
        names, base = self.offload_base(session_id, entry, kept)
        if base is not None:
            store.host.acquire(base)  # (ours while room is made: never the first to go)
        if kept is not None:
            store.host.release(kept)  # (what the new copy continues stays)
        start = len(base.token_ids) if base is not None else entry.prefix_tokens
        ends: list[tuple[int, str | None]] = []
        if names and len(names) * CHUNK_TOKENS > start and (base is None or base.name is not None):
            # its system prompt's chunks, named: its owner's (never on top of a copy of this session's alone)
            ends.append((len(names) * CHUNK_TOKENS, names[-1]))
        ends.append((entry.num_tokens, None))  # the rest, its own
        copied = self._copy_out(session_id, entry, ends, base, kv_dtype, scope)
        if copied is None:
            return
        host_entry, written = copied
        store.on_copy("offload", "host", time.perf_counter() - started)
        store.counters["host_offload_bytes"] += written
        store.counters["host_offload_bytes_skipped"] += _stored_bytes(base) if base is not None else 0
        if not _left_intact(entry, host_entry, start):  # changed while resident: never launder it into the host tier
            store.host.release(host_entry)
            store.report_corruption(session_id, ("checksum",))
            return
        store.host.put(session_id, host_entry)
        store.host.release(host_entry)

    def _copy_out(self, session_id: str, entry: CacheEntry, ends: list[tuple[int, str | None]],
                  base: HostEntry | None, kv_dtype: KVDtype, scope: str) -> tuple[HostEntry, int] | None:
        """Copy the cache's positions after `base` (which the caller holds) to the host tier, one copy up to each of
        `ends` (a named one: its owner's system prompt's chunks); the last copy, which the caller then holds
        instead of `base`, and the bytes written. None: it did not fit, or the copy failed, and the cache is
        lost."""
        store = self.store
        host_entry, written, buffer = base, 0, None
        try:
            store.faults.check("offload", session_id)
            for end, name in ends:
                first = len(host_entry.token_ids) if host_entry is not None else entry.prefix_tokens
                need = host_nbytes(entry, kv_dtype, first - entry.prefix_tokens, end - entry.prefix_tokens)
                dropped, fits = store.host.make_room(need, needed=self._segment_needed)
                for key in dropped:
                    store.remember_loss(key)
                    store.counters["host_evictions"] += 1
                if not fits:
                    self._abandon_offload(session_id, host_entry, lost=True)
                    return None
                buffer = store.host.pool.take(need) if need else None
                built = store.offloader.offload(entry, buffer, kv_dtype, base=host_entry, end=end)
                buffer, written = None, written + need  # (the copy holds it now)
                store.host.acquire(built)  # (the longer chain is ours; the shorter, in it, is let go)
                if host_entry is not None:
                    store.host.release(host_entry)
                host_entry = built
                if name is not None:  # others of this owner continue it: it is theirs as much as this session's
                    host_entry.name, host_entry.scope = name, scope
                    host_entry.fingerprint = dataclasses.replace(
                        host_entry.fingerprint, owner=scope, num_tokens=end,
                        token_digest=token_digest(entry.token_ids[:end]))
        except Exception as error:
            log_failure(log, error, "offloading session %s's cache failed; it is dropped and its next turn "
                                    "recomputes", session_id)
            if buffer is not None:
                store.host.pool.give(buffer)
            self._abandon_offload(session_id, host_entry, lost=False)
            store.counters["offload_failures"] += 1
            store.drop(session_id)
            return None
        return host_entry, written

    def offload_base(self, session_id: str, entry: CacheEntry, kept: HostEntry | None
                     ) -> tuple[list[str], HostEntry | None]:
        """The chunk names of a session's system prompt in the host tier, and the copy its offload continues: the
        longer of its own chain `kept` and the named copy of its system prompt's chunks its owner holds (then with
        one copy of the rest, as its own); at most `MAX_HOST_COPIES` copies in the chain it makes."""
        if is_segment(session_id):
            return [], None
        store = self.store
        prompt = min(entry.num_tokens, store.prompt_tokens(session_id)) // CHUNK_TOKENS * CHUNK_TOKENS
        names = chain_hashes(entry.token_ids[:prompt],
                             self._host_identity(session_id, entry, store.host_kv_dtype)) if prompt else []

        def usable(candidate: HostEntry | None) -> bool:  # (one copy more stays within the bound)
            return candidate is not None and len(candidate.pieces()) < MAX_HOST_COPIES \
                and _continued_by(candidate, entry, store.host_kv_dtype)

        candidates = [candidate for candidate in (kept, store.host.named(names, usable)) if usable(candidate)]
        return names, max(candidates, key=lambda candidate: len(candidate.token_ids), default=None)

    def _host_identity(self, session_id: str, entry: CacheEntry, kv_dtype: KVDtype) -> str:
        """What makes two sessions' host copies interchangeable: their owner, how the copy is stored, and the
        shared segment it starts with (whose positions are not in it)."""
        store = self.store
        kind = "int8" if kv_dtype == "int8" else "from-int8" if entry.quantized else "exact"
        prefix = entry.cache.prefix.segment_key if isinstance(entry.cache, ArenaCache) and entry.cache.prefix else ""
        return chunk_identity(store.model_key, store.scope_of(session_id), store.layout,
                              f"host {kind} after {prefix or 'nothing'}:{entry.prefix_tokens}")

    def _abandon_offload(self, session_id: str, held: HostEntry | None, lost: bool) -> None:
        """An offload that cannot finish: the chain it held is let go (the copies it made go back to the pool),
        the cache is lost."""
        store = self.store
        if held is not None:
            store.host.release(held)
        store.faults.disarm(session_id)
        if lost:
            store.counters["host_evictions"] += 1
        store.remember_loss(session_id)


def _stored_bytes(entry: HostEntry) -> int:
    """The host bytes of a chain of copies: what an offload that continues it did not write again."""
    return sum(piece.nbytes for piece in entry.pieces())


def _continued_by(base: HostEntry, entry: CacheEntry, kv_dtype: KVDtype) -> bool:
    """Whether `entry` (resident) continues the host copy `base` it was restored from: the same owner, segment,
    first positions and storage, so that an offload may copy only the positions after it."""
    prefix = entry.cache.prefix if isinstance(entry.cache, ArenaCache) else None
    return (base.fingerprint is not None and entry.fingerprint is not None
            and (base.name is not None or base.fingerprint.owner == entry.fingerprint.owner)  # (a name says whose)
            and base.prefix_key == (prefix.segment_key if prefix is not None else None)
            and base.prefix_tokens == entry.prefix_tokens and len(base.token_ids) <= entry.num_tokens
            and entry.token_ids[:len(base.token_ids)] == base.token_ids
            and all((piece.scales is not None) == (kv_dtype == "int8") for piece in base.pieces()))


def _left_intact(entry: CacheEntry, host_entry: HostEntry, start: int) -> bool:
    """Whether the cache reached the host with the bytes it was written back with (those it copied, from
    `start`)."""
    if entry.checksum is None:
        return True
    if entry.suffix_checksum is not None and entry.suffix_checksum[0] == start \
            and entry.suffix_checksum[2] == entry.checksum:  # taken at write-back for the positions copied
        own = start - entry.prefix_tokens
        return checksum([(k[..., own:, :], v[..., own:, :]) for k, v in entry.tensors()]) == entry.suffix_checksum[1]
    if host_entry.base is None and host_entry.scales is None and \
            entry.checksum.split(":")[0] == host_entry.checksum.split(":")[0]:
        return host_entry.checksum == entry.checksum  # read the same way: the copy's checksum says it
    return checksum(entry.tensors()) == entry.checksum
