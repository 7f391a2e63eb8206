"""Moving caches between the device and Redis (`--remote-kv`), as runs of chunks: a write-back's snapshot of
only the positions Redis is not known to hold, and a fetch of only the chunks after what the device holds (the
session's own older copy, or the segment of its system prompt), each chunk checked, up to the last good one.

A fetch never runs on the engine thread (vLLM's asynchronous KV connectors do the same): the engine asks for one
(`FetchRequest`, what the device holds named by its ids), `fetch_copy` runs on the remote tier's I/O thread (the
header, the decision, the chunks and every check of their bytes), and the turn waits in its own state while the
batch decodes on; the engine then copies what arrived into the arena (`RemoteMoves.adopt`), or recomputes.

Plain transfers, as the host tier's moves (`tier_moves.py`): the cache store decides what moves and records it.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

import cache_store.device.chain as chain
from cache_store.checks.integrity import (
    Check,
    check_finite,
    check_identity,
    check_scales,
    check_tensors,
    checksum,
    fingerprint,
)
from cache_store.device.arena import ArenaCache
from cache_store.device.entry import CacheEntry, KVTensors, NewCache, entry_from_parts
from cache_store.failure_log import log_failure
from cache_store.host.offload import HostEntry, Offloader
from cache_store.identity import CacheLayout
from cache_store.remote.chunks import chunk_identity, chunk_names, shared_chunks
from cache_store.remote.cost_model import CostModel, RemoteDecision
from cache_store.remote.remote_caches import RemoteCaches
from cache_store.remote.remote_format import RemoteCopy, RemoteHeader, RemoteSnapshot, StoredKV
from cache_store.units import GROUP_TOKENS, KVDtype

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldIds:
    """What the device holds that a fetch may keep, by its ids: the session's own older copy, or (`segment`) the
    shared segment its prompt starts with, which is kept whole or not at all."""

    token_ids: tuple[int, ...]
    segment: bool
    prefix_tokens: int  # the positions of the segments it starts with (a copy of its own positions stops there)


@dataclass(frozen=True)
class FetchRequest:
    """Everything a fetch needs, taken on the engine thread: nothing in it changes while the fetch runs."""

    session_id: str
    session_version: int  # a copy older than this is of no use (and is deleted)
    scope: str  # whose chunks (`CacheStore.scope_of`)
    model_key: str
    layout: CacheLayout
    kv_dtype: KVDtype  # this worker's --remote-kv-dtype: an int8 copy never stands in where exact ones are asked for
    held: HeldIds | None
    pin: bool  # on CUDA: fetched bytes land in pinned memory, so that their copy to the device is asynchronous


@dataclass
class FetchOutcome:
    """What a fetch found: the header (None: no usable copy), the decision, and, when fetched, the copy's ids and
    its checked parts (the first after `keep` held positions) up to the first failure (`failed`)."""

    header: RemoteHeader | None = None
    decision: RemoteDecision | None = None
    token_ids: list[int] = field(default_factory=list)
    keep: int = 0
    parts: list[StoredKV] = field(default_factory=list)
    failed: tuple[Check, ...] = ()
    counters: Counter[str] = field(default_factory=Counter)  # added to the store's by the lookup that reads it
    fetched_s: float = 0.0  # the chunks' round trip and checks

    @property
    def covered(self) -> int:
        """The positions the cache holds once adopted: those kept, then those fetched."""
        return self.keep + sum(part.tokens for part in self.parts)


class RemoteFetch:
    """A fetch under way for one turn, which waits for it at most `patience_s`: then it recomputes, and what the
    fetch brings later is dropped."""

    def __init__(self, job: Future[FetchOutcome], started: float, patience_s: float, prefill_s: float | None):
        self.job, self.started, self.patience_s, self._prefill_s = job, started, patience_s, prefill_s
        self._outcome: FetchOutcome | None = None

    @property
    def deadline(self) -> float:
        return self.started + self.patience_s

    def ready(self, now: float) -> bool:
        """Whether the turn waits no longer: the fetch has finished, or the turn's patience has run out."""
        return self.job.done() or now >= self.deadline

    def outcome(self) -> FetchOutcome:
        """What the fetch found, with how long the turn waited; a fetch still running (given up: `timeout`) or
        failed finds nothing. The same answer every time it is asked."""
        if self._outcome is None:
            self._outcome = self._settle()
        return self._outcome

    def _settle(self) -> FetchOutcome:
        waited_ms = 1000 * (time.monotonic() - self.started)
        if not self.job.done():
            self.job.cancel()
            prefill_ms = 1000 * self._prefill_s if self._prefill_s is not None else None
            return FetchOutcome(decision=RemoteDecision("timeout", None, prefill_ms, waited_ms))
        try:
            outcome = self.job.result()
        except Exception as error:  # (Redis errors are caught where they happen: anything else is a bug, logged here)
            log_failure(log, error, "fetching a cache from Redis failed; the turn recomputes")
            return FetchOutcome(counters=Counter(remote_fetch_failures=1))
        if outcome.decision is not None:
            outcome.decision = dataclasses.replace(outcome.decision, waited_ms=waited_ms)
        return outcome


def fetch_copy(request: FetchRequest, remote: RemoteCaches, cost: CostModel) -> FetchOutcome:
    """The session's copy in Redis, fetched when that is estimated to be faster than recomputing it (on the remote
    tier's I/O thread). Only the chunks after the positions the device holds are fetched (the cost counts only
    those bytes). Every chunk passes every check of its bytes here; a chunk gone or damaged ends the run there (a
    damaged one is deleted from Redis), and the turn recomputes the rest."""
    header = remote.head(request.session_id)
    if header is not None and header.fingerprint.model_key != request.model_key:
        header = None  # another model's (or checkpoint's) copy: a rolling deploy, not damage; never ours
    if header is not None and header.fingerprint.quantized and request.kv_dtype == "same":
        header = None  # a quantised copy never stands in for an exact one where exact ones are asked for
    if header is not None and header.session_version < request.session_version:
        remote.delete(request.session_id, header.session_version)  # (only this copy: never one written since)
        header = None
    if header is None:
        return FetchOutcome()
    size = header.chunk_tokens
    identity = chunk_identity(request.model_key, request.scope, request.layout, header.kind)
    keep = _kept_positions(request.held, header, identity)
    first = keep // size
    decision = cost.decide(header.fetch_nbytes(first), header.fingerprint.num_tokens - keep)
    if decision.choice == "recompute":
        return FetchOutcome(header, decision)
    started = time.perf_counter()
    copy = remote.fetch(header, first)
    if copy is None:
        return FetchOutcome(None, decision)
    failed = check_identity(header.fingerprint, request.model_key, request.session_id, copy.token_ids,
                            request.layout) \
        or (chunk_names(copy.token_ids, identity, size) != header.chunks and "fingerprint")
    if failed:
        return FetchOutcome(header, decision, failed=(failed,))
    held = request.held
    if keep and held is not None and list(held.token_ids[:keep]) != copy.token_ids[:keep]:
        return FetchOutcome(header, decision)  # (the held positions are not this cache's after all)
    outcome = FetchOutcome(header, decision, copy.token_ids, keep)
    outcome.parts, outcome.failed = _good_parts(request, header, copy, keep - first * size, outcome.counters, remote)
    outcome.counters["remote_chunks_fetched"] += sum(chunk is not None for chunk in copy.chunks)
    outcome.counters["remote_bytes_not_fetched"] += first * header.chunk_nbytes
    if request.pin:
        outcome.parts = [pinned(part) for part in outcome.parts]
    outcome.fetched_s = time.perf_counter() - started
    return outcome


def _kept_positions(held: HeldIds | None, header: RemoteHeader, identity: str) -> int:
    """How many of the copy's positions the device's `held` already has: a segment whole (if the copy is at least
    as long), or the session's own older copy up to the last chunk the two share (on a key-scale group's edge, so
    that an int8 chunk is cut where its scales are)."""
    if held is None:
        return 0
    length = len(held.token_ids)
    if held.segment:
        return length if length <= header.fingerprint.num_tokens else 0
    matched = shared_chunks(chunk_names(held.token_ids, identity, header.chunk_tokens), header.chunks)
    keep = min(max(matched * header.chunk_tokens, held.prefix_tokens), length, header.fingerprint.num_tokens)
    return keep // GROUP_TOKENS * GROUP_TOKENS


def _good_parts(request: FetchRequest, header: RemoteHeader, copy: RemoteCopy, skip: int, counters: Counter[str],
                remote: RemoteCaches) -> tuple[list[StoredKV], tuple[Check, ...]]:
    """The fetched chunks (the first after `skip` positions the device holds), then the tail, up to the first
    that is gone or fails a check; and that failure."""
    quantized, size = header.kind == "int8", header.chunk_tokens
    parts: list[StoredKV] = []
    for index, piece in enumerate(copy.chunks, start=copy.first):
        if piece is None:
            counters["remote_chunks_missing"] += 1
            log.warning("session %s: chunk %d of its Redis copy is gone; restoring the chunks before it",
                        header.session_id, index)
            return parts, ()
        failed = (piece.name != header.chunks[index] and "fingerprint") \
            or _check_stored(piece, size, quantized, request.layout)
        if failed:
            log.warning("session %s: chunk %d of its Redis copy failed the %s check; deleted, restoring the "
                        "chunks before it", header.session_id, index, failed)
            remote.delete_chunk(header.chunks[index])
            return parts, (failed,)
        parts.append(piece.after(skip))
        skip = 0
    tail_tokens = header.fingerprint.num_tokens - len(header.chunks) * size
    if failed := _check_stored(copy.tail, tail_tokens, quantized, request.layout):
        log.warning("session %s: the tail of its Redis copy failed the %s check", header.session_id, failed)
        return parts, (failed,)
    return [*parts, copy.tail.after(skip)], ()


def _check_stored(piece: StoredKV, tokens: int, quantized: bool, layout: CacheLayout) -> Check | None:
    """Shapes, the checksum of every stored byte (scales included) and finite values (of the scales, for int8)
    of a chunk or tail from Redis."""
    stored_layout = dataclasses.replace(layout, dtype=torch.int8) if quantized else layout
    return (check_tensors(piece.tensors, tokens, stored_layout)
            or (quantized and (check_scales(piece.scales, tokens, layout) if piece.scales else "shape"))
            or (checksum(piece.stored) != piece.checksum and "checksum")
            or check_finite(piece.scales if quantized else piece.tensors))


def pinned(part: StoredKV) -> StoredKV:
    """The part in pinned host memory (CUDA): its copy to the device then runs on the side stream, asynchronously."""
    return StoredKV([(k.pin_memory(), v.pin_memory()) for k, v in part.tensors],
                    None if part.scales is None else [(k.pin_memory(), v.pin_memory()) for k, v in part.scales],
                    part.checksum, part.name)


@dataclass
class Adoption:
    """What a fetch brings, ready to copy into place: its parts on the device, and the room they need."""

    outcome: FetchOutcome
    held: CacheEntry | None  # what the copy continues: the session's own older copy, or the segment it starts with
    tensors: list[KVTensors]
    own_bytes: int  # the device bytes of the new cache's own positions
    keep: list[str]  # what making room for it must not evict (the session, the segments it starts with)


class RemoteMoves:
    """Snapshots to Redis, and fetched copies adopted: plain transfers that return what they did (the cache store
    decides and records). On the engine thread."""

    def __init__(self, remote: RemoteCaches, offloader: Offloader, new_cache: NewCache, layout: CacheLayout,
                 model_key: str, remote_kv_dtype: KVDtype):
        self.remote, self.offloader, self.new_cache = remote, offloader, new_cache
        self.layout, self.model_key, self.remote_kv_dtype = layout, model_key, remote_kv_dtype

    def share(self, session_id: str, entry: CacheEntry, scope: str) -> Counter[str]:
        """Write the cache to Redis, in the background, as a run of chunks named for its owner (`scope`): the
        snapshot copies only the positions from the first chunk Redis is not known to hold (a shared system prompt's
        chunks, and the turns before, are there already), int8 quantised once, when first written. Returns the
        bytes it copied and skipped."""
        kind = "int8" if self.remote_kv_dtype == "int8" else "from-int8" if entry.quantized else "exact"
        chunks = chunk_names(entry.token_ids, chunk_identity(self.model_key, scope, self.layout, kind),
                              self.remote.chunk_tokens)
        start = self.remote.known_chunks(chunks)
        tensors, scales = self.offloader.snapshot(entry, start * self.remote.chunk_tokens, self.remote_kv_dtype)
        stamp = dataclasses.replace(entry.fingerprint, quantized="int8") if scales is not None else entry.fingerprint
        self.remote.put(session_id, RemoteSnapshot(list(entry.token_ids), stamp, entry.session_version, kind, chunks,
                                                   start, tensors, scales))
        # the keys and values (in the model's dtype) of the chunks Redis holds: neither copied nor sent
        skipped = start * self.remote.chunk_tokens
        return Counter({"remote_snapshot_bytes": sum(k.nbytes + v.nbytes for k, v in [*tensors, *(scales or [])]),
                        "remote_snapshot_kv_bytes_skipped": skipped * self.layout.token_bytes})

    def request(self, session_id: str, session_version: int, scope: str, own: CacheEntry | HostEntry | None,
                segment: CacheEntry | None) -> FetchRequest:
        """Ask for the session's copy in Redis (its chunks named for `scope`), naming by their ids what a fetch may
        keep: the session's own older copy (`own`, on the device or the host), else the segment its prompt starts
        with."""
        if isinstance(own, HostEntry):
            held = HeldIds(tuple(own.token_ids), False, own.prefix_tokens)
        else:
            held = self.held_ids(own if own is not None else segment)
        return FetchRequest(session_id, session_version, scope, self.model_key, self.layout, self.remote_kv_dtype,
                            held, pin=self.offloader.pins_memory)

    def start(self, request: FetchRequest, prompt_tokens: int, cost: CostModel,
              done: Callable[[], None]) -> RemoteFetch:
        """Fetch on the remote tier's threads (`done` called there once it has finished); the turn waits at most as
        long as recomputing its `prompt_tokens` is estimated to take."""
        job = self.remote.submit(lambda: fetch_copy(request, self.remote, cost))
        job.add_done_callback(lambda _: done())
        patience = cost.patience_s(prompt_tokens, self.remote.timeout_s)
        return RemoteFetch(job, time.monotonic(), patience, cost.prefill_s(prompt_tokens))

    def held_ids(self, held: CacheEntry | None) -> HeldIds | None:
        """What a fetch may keep of `held` (a cache on the device: the session's own, or a segment)."""
        if held is None or not isinstance(held.cache, ArenaCache):
            return None
        return HeldIds(tuple(held.token_ids), held.cache.frozen, held.prefix_tokens)

    def prepare(self, session_id: str, outcome: FetchOutcome, held: CacheEntry | None) -> Adoption | None:
        """What a fetch brought, on the device, ready to follow the positions `held` keeps (the session's own older
        copy, continued in place, or the segment the new cache starts with); None when nothing was fetched to
        continue what is held, or `held` no longer holds what the fetch counted on (then the turn recomputes)."""
        keep = outcome.keep
        if keep:
            usable = held is not None and isinstance(held.cache, ArenaCache) and held.num_tokens >= keep \
                and (not held.cache.frozen or held.num_tokens == keep) \
                and held.token_ids[:keep] == outcome.token_ids[:keep]
            if not usable:
                return None
        held = held if keep else None
        if not outcome.parts and (held is None or held.cache.frozen):  # nothing fetched to continue what is held
            return None
        tensors = self.offloader.to_device([(part.tensors, part.scales) for part in outcome.parts], self.layout.dtype)
        own_bytes = (outcome.covered - (held.prefix_tokens if held is not None else 0)) * self.layout.token_bytes
        kept = [session_id, *(s.segment_key for s in chain.segments(held.cache))] if held is not None else []
        if held is not None and held.cache.frozen:
            kept.append(held.cache.segment_key)
        return Adoption(outcome, held, tensors, own_bytes, kept or [session_id])

    def adopt(self, session_id: str, adoption: Adoption) -> CacheEntry:
        """Copy a prepared fetch into the arena: the session's older copy continued in place (the same entry), or a
        new cache after the segment it starts with (the caller holds it)."""
        outcome, held, header = adoption.outcome, adoption.held, adoption.outcome.header
        covered = outcome.covered
        if held is not None and not held.cache.frozen:  # the session's own older copy: continued in place
            held.crop(outcome.keep)
            held.cache.append_parts(adoption.tensors)
            held.token_ids[outcome.keep:] = outcome.token_ids[outcome.keep:covered]
            entry = held
        else:
            entry = entry_from_parts(self.new_cache, adoption.tensors, outcome.token_ids[:covered], owned=True,
                                     prefix=held.cache if held is not None else None)
        lossy = header.fingerprint.quantized or (held.quantized if held is not None else None)
        entry.fingerprint = dataclasses.replace(header.fingerprint, quantized=lossy)
        if covered < header.fingerprint.num_tokens:
            entry.fingerprint = dataclasses.replace(fingerprint(entry, self.model_key, session_id, self.layout),
                                                    quantized=lossy)
        entry.checksum = None  # (handed to a turn, which changes it at once: its write-back takes one)
        entry.session_version = header.session_version
        return entry
