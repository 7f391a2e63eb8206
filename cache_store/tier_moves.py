"""Copies between the device and the host tier, checked both ways: a device cache offloaded (exact or int8; a
shared segment once, exact; a session's continuing the copy of its system prompt its owner's sessions share, or
its own stack), and a host copy checked and copied back into a new device cache, after the shared segment it names
(so that a segment is never copied twice). (Redis: `remote_moves.py`.)

Plain transfers: a move takes what it needs and returns what it did (`Moved`: the check a copy failed, the
sessions whose host copies went to make room, bytes, seconds); it never decides what moves and never calls the
tiers it works for (`CacheTiers` decides and records). In the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass, field

import torch

from cache_store.checks.integrity import (
    Check,
    check_finite,
    check_identity,
    check_scales,
    check_tensors,
    checksum,
    fingerprint,
    token_digest,
)
from cache_store.checks.stage_faults import FaultPoints
from cache_store.device.arena import ArenaCache
from cache_store.device.entry import CacheEntry, NewCache
from cache_store.device.segments import is_segment
from cache_store.failure_log import log_failure
from cache_store.host.host_tier import HostTier
from cache_store.host.offload import HostEntry, Offloader, host_nbytes
from cache_store.identity import CacheLayout
from cache_store.remote.chunks import CHUNK_TOKENS, chunk_identity, chunk_names
from cache_store.units import KVDtype

log = logging.getLogger(__name__)
# A stack of host copies is restored copy by copy (each checked, each copied into place): past this many, an
# offload copies again all that follows the system prompt's named copy, so that a restore stays fast
# (docs/benchmarks.md).
MAX_HOST_COPIES = 5


@dataclass
class Moved:
    """What a move did, for the tiers to record."""

    failed: tuple[Check, ...] = ()  # the check a copy failed (an offload: the cache changed while resident)
    lost: list[str] = field(default_factory=list)  # sessions whose cache is gone from the host tier (room, failure)
    counters: Counter[str] = field(default_factory=Counter)
    seconds: float | None = None  # the copy's time, for latency metrics (None: nothing was moved)
    dropped: bool = False  # the offload failed: the cache is gone, and the tiers drop it everywhere


class TierMoves:
    """Offload and restore copies between device caches and the host tier."""

    def __init__(self, host: HostTier, offloader: Offloader, new_cache: NewCache, layout: CacheLayout,
                 model_key: str, host_kv_dtype: KVDtype, faults: FaultPoints):
        self.host, self.offloader, self.new_cache = host, offloader, new_cache
        self.layout, self.model_key, self.host_kv_dtype, self.faults = layout, model_key, host_kv_dtype, faults

    def last_good(self, owner: str, stack: HostEntry, scope: str) -> tuple[HostEntry | None, tuple[Check, ...]]:
        """The newest copy of `owner`'s stack whose copies all pass every check (None: not even the first), and the
        failure of the copy after it, which is forgotten (no later offload continues it; every stack that includes
        it checks it too). `scope`: whose chunks `owner`'s named copies may be."""
        pieces, good = stack.pieces(), None
        for index, piece in enumerate(pieces):
            if failed := self._check_piece(owner, piece, scope):
                self.host.forget(pieces[index])
                return good, (failed,)
            good = piece
        return good, ()

    def _check_piece(self, owner: str, host_entry: HostEntry, scope: str) -> Check | None:
        """Every check of one copy of a stack; a named copy belongs to the owner whose chunks it holds, which must
        be `owner`'s."""
        if host_entry.name is not None:
            if host_entry.scope not in (scope, f"session:{owner}"):  # (the latter: its own alone)
                return "fingerprint"
            owner = host_entry.scope
        tokens, quantized = host_entry.own_tokens, host_entry.scales is not None
        stored_layout = dataclasses.replace(self.layout, dtype=torch.int8) if quantized else self.layout
        return (check_identity(host_entry.fingerprint, self.model_key, owner, host_entry.token_ids, self.layout)
                or (quantized and host_entry.fingerprint.quantized != "int8" and "fingerprint")
                or check_tensors(host_entry.tensors, tokens, stored_layout)
                or (quantized and check_scales(host_entry.scales, tokens, self.layout))
                or (checksum(host_entry.stored) != host_entry.checksum and "checksum")
                or check_finite(host_entry.scales if quantized else host_entry.tensors))

    def segment_needed(self, key: str) -> bool:
        """Whether a shared segment's host copy is needed: a host copy of a session's cache starts with it (one
        still on the device keeps its own; a new session finds it on the device, or recomputes it)."""
        return any(self.host.get(other).prefix_key == key for other in self.host.keys())

    def copy_in(self, key: str, good: HostEntry, segment: CacheEntry | None, stamp: bool = True) -> CacheEntry:
        """A new device cache (the caller holds it) holding the checked copy `good`, starting with `segment` when
        the copy names one. `stamp`: take its checksum now (not for a turn, which changes it at once: its
        write-back takes one)."""
        entry, copied = self.offloader.restore(good, self.new_cache, segment.cache if segment else None)
        for piece in good.pieces():  # (a host copy stays until the restore has read it)
            piece.restoring = copied
        try:
            self.faults.check("restore", key)  # (a copy that fails once it has begun, for tests and drills)
        except BaseException:
            entry.release()
            raise
        # The checksum verified on the host is the device's when both are read the same way (on a CPU, at
        # full precision, one copy); a GPU reads the device copy with its own kind, and a dequantised copy or a
        # stack of copies is new bytes.
        same_bytes = entry.tensors()[0][0].device.type == "cpu" and good.scales is None and good.base is None
        entry.checksum = good.checksum if same_bytes else checksum(entry.tensors()) if stamp else None
        if good.name is not None:  # (a named copy's fingerprint is its owner's: the cache is the session's)
            entry.fingerprint = fingerprint(entry, self.model_key, key, self.layout)
        return entry

    def offload(self, session_id: str, entry: CacheEntry, scope: str, prompt_tokens: int) -> Moved:
        """Copy a device cache (which the caller holds) to the host tier, whose oldest entries make room; a cache
        that does not fit there, or whose offload fails, is lost (`Moved.lost`, `dropped`). A session's cache
        continues its own stack (kept since its restore) or the copy of its system prompt's chunks its owner's
        sessions share (named, held once): only the positions after it are copied (`offload_base`)."""
        moved = Moved()
        moved.counters["segment_offloads" if is_segment(session_id) else "device_evictions"] += 1
        kv_dtype = "same" if is_segment(session_id) else self.host_kv_dtype  # a segment is held once: exact
        kept = None if is_segment(session_id) else self.host.take(session_id)  # kept from its restore: ours
        started = time.perf_counter()
        if kept is not None and len(kept.token_ids) == entry.num_tokens and _continued_by(kept, entry, kv_dtype):
            self.host.put(session_id, kept)  # nothing added since it was restored
            self.host.release(kept)
            moved.counters["host_offload_bytes_skipped"] += _stored_bytes(kept)
            moved.seconds = time.perf_counter() - started
            return moved
        names, base = self.offload_base(session_id, entry, kept, scope, prompt_tokens)
        if base is not None:
            self.host.acquire(base)  # (ours while room is made: never the first to go)
        if kept is not None:
            self.host.release(kept)  # (what the new copy continues stays)
        start = len(base.token_ids) if base is not None else entry.prefix_tokens
        ends: list[tuple[int, str | None]] = []
        if names and len(names) * CHUNK_TOKENS > start and (base is None or base.name is not None):
            # its system prompt's chunks, named: its owner's (never on top of a copy of this session's alone)
            ends.append((len(names) * CHUNK_TOKENS, names[-1]))
        ends.append((entry.num_tokens, None))  # the rest, its own
        host_entry = self._copy_out(session_id, entry, ends, base, kv_dtype, scope, moved)
        if host_entry is None:
            return moved
        moved.seconds = time.perf_counter() - started
        moved.counters["host_offload_bytes_skipped"] += _stored_bytes(base) if base is not None else 0
        if not _left_intact(entry, host_entry, start):  # changed while resident: never launder it into the host tier
            self.host.release(host_entry)
            moved.failed = ("checksum",)
            return moved
        self.host.put(session_id, host_entry)
        self.host.release(host_entry)
        return moved

    def _copy_out(self, session_id: str, entry: CacheEntry, ends: list[tuple[int, str | None]],
                  base: HostEntry | None, kv_dtype: KVDtype, scope: str, moved: Moved) -> HostEntry | None:
        """Copy the cache's positions after `base` (which the caller holds) to the host tier, one copy up to each of
        `ends` (a named one: its owner's system prompt's chunks); the last copy, which the caller then holds
        instead of `base`. None: it did not fit, or the copy failed, and the cache is lost."""
        host_entry, buffer = base, None
        try:
            self.faults.check("offload", session_id)
            for end, name in ends:
                first = len(host_entry.token_ids) if host_entry is not None else entry.prefix_tokens
                need = host_nbytes(entry, kv_dtype, first - entry.prefix_tokens, end - entry.prefix_tokens)
                dropped, fits = self.host.make_room(need, needed=self.segment_needed)
                moved.lost += dropped
                moved.counters["host_evictions"] += len(dropped)
                if not fits:
                    self._abandon(session_id, host_entry, moved)
                    moved.counters["host_evictions"] += 1
                    return None
                buffer = self.host.pool.take(need) if need else None
                built = self.offloader.offload(entry, buffer, kv_dtype, base=host_entry, end=end)
                buffer = None  # (the copy holds it now)
                moved.counters["host_offload_bytes"] += need
                self.host.acquire(built)  # (the longer stack is ours; the shorter, in it, is let go)
                if host_entry is not None:
                    self.host.release(host_entry)
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
                self.host.pool.give(buffer)
            self._abandon(session_id, host_entry, moved)
            moved.counters["offload_failures"] += 1
            moved.dropped = True
            return None
        return host_entry

    def offload_base(self, session_id: str, entry: CacheEntry, kept: HostEntry | None, scope: str,
                     prompt_tokens: int) -> tuple[list[str], HostEntry | None]:
        """The chunk names of a session's system prompt (`prompt_tokens` long) in the host tier, and the copy its
        offload continues: the longer of its own stack `kept` and the named copy of its system prompt's chunks its
        owner holds (then with one copy of the rest, as its own); at most `MAX_HOST_COPIES` copies in the stack it
        makes."""
        if is_segment(session_id):
            return [], None
        prompt = min(entry.num_tokens, prompt_tokens) // CHUNK_TOKENS * CHUNK_TOKENS
        names = chunk_names(entry.token_ids[:prompt], self._host_identity(entry, scope)) if prompt else []

        def usable(candidate: HostEntry | None) -> bool:  # (one copy more stays within the bound)
            return candidate is not None and len(candidate.pieces()) < MAX_HOST_COPIES \
                and _continued_by(candidate, entry, self.host_kv_dtype)

        candidates = [candidate for candidate in (kept, self.host.named(names, usable)) if usable(candidate)]
        return names, max(candidates, key=lambda candidate: len(candidate.token_ids), default=None)

    def _host_identity(self, entry: CacheEntry, scope: str) -> str:
        """What makes two sessions' host copies interchangeable: their owner, how the copy is stored, and the
        shared segment it starts with (whose positions are not in it)."""
        kind = "int8" if self.host_kv_dtype == "int8" else "from-int8" if entry.quantized else "exact"
        prefix = entry.cache.prefix.segment_key if isinstance(entry.cache, ArenaCache) and entry.cache.prefix else ""
        return chunk_identity(self.model_key, scope, self.layout,
                              f"host {kind} after {prefix or 'nothing'}:{entry.prefix_tokens}")

    def _abandon(self, session_id: str, held: HostEntry | None, moved: Moved) -> None:
        """An offload that cannot finish: the stack it held is let go (the copies it made go back to the pool),
        the cache is lost."""
        if held is not None:
            self.host.release(held)
        self.faults.disarm(session_id)
        moved.lost.append(session_id)


def _stored_bytes(entry: HostEntry) -> int:
    """The host bytes of a stack of copies: what an offload that continues it did not write again."""
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
