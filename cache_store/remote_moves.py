"""Moving caches between the device and Redis (`--remote-kv`), as chains of chunks: a write-back's snapshot of
only the positions Redis is not known to hold, and a fetch of only the chunks after what the device holds (the
session's own older copy, or the segment of its policy), each chunk checked, up to the last good one.

Part of the cache store (`CacheStore` decides what moves; this does the moving), in the engine thread.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Sequence
from typing import Protocol

import torch

import cache_store.chain as chain
from cache_store.arena import UNIT, ArenaCache
from cache_store.chunks import chain_hashes, chunk_identity, shared_chunks
from cache_store.cost_model import CostModel, RemoteDecision
from cache_store.entry import CacheEntry, entry_from_parts
from cache_store.integrity import (
    Check,
    check_finite,
    check_identity,
    check_scales,
    check_tensors,
    checksum,
    fingerprint,
)
from cache_store.lookup import RemoteCaches
from cache_store.quantize import GROUP_TOKENS, KVDtype
from cache_store.remote_tier import RemoteCopy, RemoteHeader, RemoteSnapshot, StoredKV
from cache_store.segments import segment_key
from cache_store.tier_moves import TierOwner

log = logging.getLogger(__name__)


class RemoteOwner(TierOwner, Protocol):
    """What the Redis moves need of the cache store beyond the host moves' needs."""

    remote: RemoteCaches
    remote_kv_dtype: KVDtype
    min_shared_tokens: int
    cost: CostModel


class RemoteMoves:
    """Snapshots to Redis and fetches from it for one cache store."""

    def __init__(self, store: RemoteOwner):
        self.store = store

    def share(self, session_id: str, entry: CacheEntry) -> None:
        """Write the cache to Redis, in the background, as a chain of chunks named for its owner: the snapshot
        copies only the positions from the first chunk Redis is not known to hold (a shared policy's chunks, and
        the turns before, are there already), int8 quantised once, when first written."""
        store = self.store
        kind = "int8" if store.remote_kv_dtype == "int8" else "from-int8" if entry.quantized else "exact"
        chunks = chain_hashes(entry.token_ids, chunk_identity(store.model_key, store.scope_of(session_id), store.layout,
                                                              kind), store.remote.chunk_tokens)
        start = store.remote.known_chunks(chunks)
        tensors, scales = store.offloader.snapshot(entry, start * store.remote.chunk_tokens, store.remote_kv_dtype)
        stamp = dataclasses.replace(entry.fingerprint, quantized="int8") if scales is not None else entry.fingerprint
        store.remote.put(session_id, RemoteSnapshot(list(entry.token_ids), stamp, entry.session_version, kind, chunks,
                                                   start, tensors, scales))
        store.counters["remote_snapshot_bytes"] += sum(k.nbytes + v.nbytes for k, v in [*tensors, *(scales or [])])
        # the keys and values (in the model's dtype) of the chunks Redis holds: neither copied nor sent
        skipped = start * store.remote.chunk_tokens
        store.counters["remote_snapshot_kv_bytes_skipped"] += skipped * store.layout.token_bytes

    def fetch(self, session_id: str, header: RemoteHeader, held: CacheEntry | None
              ) -> tuple[CacheEntry | None, RemoteDecision, tuple[Check, ...]]:
        """The session's cache from Redis, for a turn, when fetching is estimated to be faster than recomputing.
        `held` (a checked cache on the device: the session's own older copy, or the shared segment its prompt starts
        with)
        keeps the positions whose chunks it has, and only the chunks after them and the tail are fetched (the cost
        counts only those bytes). Every chunk passes every check before use; a chunk gone or damaged ends the
        chain there (a damaged one is deleted from Redis): the cache is restored up to the last good chunk, with
        the failure, and its turn recomputes the rest."""
        store = self.store
        size = header.chunk_tokens
        identity = chunk_identity(store.model_key, store.scope_of(session_id), store.layout, header.kind)
        held = held if held is not None and isinstance(held.cache, ArenaCache) else None
        keep = 0
        if held is not None and held.cache.frozen:  # a segment: started with whole, if the ids say it may be
            keep = held.num_tokens if held.num_tokens <= header.fingerprint.num_tokens else 0
        elif held is not None:
            matched = shared_chunks(chain_hashes(held.token_ids, identity, size), header.chunks)
            keep = min(max(matched * size, held.prefix_tokens), held.num_tokens, header.fingerprint.num_tokens)
            keep = keep // GROUP_TOKENS * GROUP_TOKENS  # (so that an int8 chunk is cut on a key-scale group's edge)
        held = held if keep else None
        first = keep // size
        decision = store.cost.decide(header.fetch_nbytes(first), header.fingerprint.num_tokens - keep)
        if decision.choice == "recompute":
            return None, decision, ()
        started = time.perf_counter()
        copy = store.remote.fetch(header, first)
        if copy is None:
            return None, decision, ()
        failed = check_identity(header.fingerprint, store.model_key, session_id, copy.token_ids, store.layout) \
            or (chain_hashes(copy.token_ids, identity, size) != header.chunks and "fingerprint")
        if failed:
            return None, decision, (failed,)
        if held is not None and copy.token_ids[:keep] != held.token_ids[:keep]:
            return None, decision, ()  # (the held positions are not this cache's after all)
        parts, failed = self._good_parts(header, copy, keep - first * size)
        store.counters["remote_chunks_fetched"] += sum(chunk is not None for chunk in copy.chunks)
        store.counters["remote_bytes_not_fetched"] += first * header.chunk_nbytes
        if not parts and (held is None or held.cache.frozen):  # nothing fetched to continue what is held
            return None, decision, failed
        covered = keep + sum(part.tokens for part in parts)
        tensors = store.offloader.to_device([(part.tensors, part.scales) for part in parts], store.layout.dtype)
        fetched_s = time.perf_counter() - started
        own_bytes = (covered - (held.prefix_tokens if held is not None else 0)) * store.layout.token_bytes
        keep_keys = [session_id, *(s.segment_key for s in chain.segments(held.cache))] if held is not None else []
        if held is not None and held.cache.frozen:
            keep_keys.append(held.cache.segment_key)
        store.make_room(store.device.extra_bytes(session_id, own_bytes), keep=keep_keys or session_id)
        copy_started = time.perf_counter()
        if held is not None and not held.cache.frozen:  # the session's own older copy: continued in place
            held.crop(keep)
            held.cache.append_parts(tensors)
            held.token_ids[keep:] = copy.token_ids[keep:covered]
            entry = held
        else:
            entry = entry_from_parts(store.new_cache, tensors, copy.token_ids[:covered], owned=True,
                                     prefix=held.cache if held is not None else None)
        lossy = header.fingerprint.quantized or (held.quantized if held is not None else None)
        entry.fingerprint = dataclasses.replace(header.fingerprint, quantized=lossy)
        if covered < header.fingerprint.num_tokens:
            entry.fingerprint = dataclasses.replace(fingerprint(entry, store.model_key, session_id, store.layout),
                                                    quantized=lossy)
        entry.checksum = None  # (handed to a turn, which changes it at once: its write-back takes one)
        entry.session_version = header.session_version
        store.device.put(session_id, entry, connected=session_id in store.connected)
        store.on_copy("restore", "remote", fetched_s + time.perf_counter() - copy_started)
        store.counters["remote_restores"] += 1
        return entry, decision, failed

    def _good_parts(self, header: RemoteHeader, copy: RemoteCopy, skip: int
                    ) -> tuple[list[StoredKV], tuple[Check, ...]]:
        """The fetched chunks (the first after `skip` positions the device holds), then the tail, up to the first
        that is gone or fails a check; and that failure."""
        store = self.store
        quantized, size = header.kind == "int8", header.chunk_tokens
        parts: list[StoredKV] = []
        for index, piece in enumerate(copy.chunks, start=copy.first):
            if piece is None:
                store.counters["remote_chunks_missing"] += 1
                log.warning("session %s: chunk %d of its Redis copy is gone; restoring the chunks before it",
                            header.session_id, index)
                return parts, ()
            failed = (piece.name != header.chunks[index] and "fingerprint") \
                or self._check_stored(piece, size, quantized)
            if failed:
                log.warning("session %s: chunk %d of its Redis copy failed the %s check; deleted, restoring the "
                            "chunks before it", header.session_id, index, failed)
                store.remote.delete_chunk(header.chunks[index])
                return parts, (failed,)
            parts.append(piece.after(skip))
            skip = 0
        tail_tokens = header.fingerprint.num_tokens - len(header.chunks) * size
        if failed := self._check_stored(copy.tail, tail_tokens, quantized):
            log.warning("session %s: the tail of its Redis copy failed the %s check", header.session_id, failed)
            return parts, (failed,)
        return [*parts, copy.tail.after(skip)], ()

    def _check_stored(self, piece: StoredKV, tokens: int, quantized: bool) -> Check | None:
        """Shapes, the checksum of every stored byte (scales included) and finite values (of the scales, for int8)
        of a chunk or tail from Redis."""
        layout = self.store.layout
        stored_layout = dataclasses.replace(layout, dtype=torch.int8) if quantized else layout
        return (check_tensors(piece.tensors, tokens, stored_layout)
                or (quantized and (check_scales(piece.scales, tokens, layout) if piece.scales else "shape"))
                or (checksum(piece.stored) != piece.checksum and "checksum")
                or check_finite(piece.scales if quantized else piece.tensors))

    def hold_policy(self, session_id: str, entry: CacheEntry, prompt_ids: Sequence[int], prefix_len: int,
                     scope: str | None) -> None:
        """After a restore from Redis, make the whole units of the prompt's system prompt a shared segment here
        (nothing copied) when none holds it yet: the next session with that policy starts with it, and a later
        restore from Redis fetches none of its chunks."""
        store = self.store
        tokens = prefix_len // UNIT * UNIT
        key = segment_key(prompt_ids[:prefix_len], scope)
        if (tokens < max(UNIT, store.min_shared_tokens) or not isinstance(entry.cache, ArenaCache)
                or entry.prefix_tokens or entry.num_tokens <= tokens or key in store.device
                or entry.token_ids[:prefix_len] != list(prompt_ids[:prefix_len])):
            return
        segment = CacheEntry(chain.split(entry.cache, tokens), entry.token_ids[:tokens])
        segment.cache.segment_key = key
        store.segments.stamp(key, segment)
        store.device.put(key, segment)
        store.counters["remote_policies_held"] += 1
