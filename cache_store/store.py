"""The cache boundary. A turn asks what it may reuse and gets one `CacheLookup` back; everything
about tiers, eviction, offload and sharing stays behind this object, which decides a lookup's order (device, host,
Redis, a shared prefix, miss) and leaves every move between tiers to `CacheTiers`, the only holder of the tiers.

Not thread-safe: the engine thread is its only caller.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import weakref
from collections import Counter
from collections.abc import Callable, Sequence

from cachetools import LRUCache

import cache_store.device.chain as chain
from cache_store.branches import fork
from cache_store.checks.integrity import Check, checksum, fingerprint
from cache_store.checks.stage_faults import FaultPoints
from cache_store.device.arena import UNIT, ArenaCache, ArenaFull, TemporaryCache
from cache_store.device.device_tier import DeviceTier
from cache_store.device.entry import CacheEntry, NewCache
from cache_store.device.eviction import ConnectedLRUPolicy, EvictionPolicy
from cache_store.device.segments import SharedSegments, segment_key
from cache_store.host.host_pool import HostBufferPool
from cache_store.host.host_tier import HostTier
from cache_store.host.offload import Offloader
from cache_store.identity import CacheLayout
from cache_store.lookup import (
    CacheLookup,
    CacheQuery,
    CacheSource,
    CopyObserver,
    MissReason,
    SessionRunning,
    common_prefix_length,
)
from cache_store.remote.cost_model import CostModel, RemoteDecision, Throughput
from cache_store.remote.remote_caches import RemoteCaches
from cache_store.remote.remote_format import EVERY_VERSION
from cache_store.remote.remote_moves import FetchRequest, RemoteFetch, RemoteMoves
from cache_store.session_notes import REMEMBERED_SESSIONS, SessionNotes
from cache_store.store_stats import store_stats
from cache_store.tier_moves import TierMoves
from cache_store.tiers import CacheTiers
from cache_store.units import KVDtype

log = logging.getLogger(__name__)


@dataclasses.dataclass
class _Found:
    """A cache a lookup found on one tier (None: none there yet), and the checks a later copy of it failed."""

    entry: CacheEntry | None
    source: CacheSource
    cleared: tuple[Check, ...] = ()


class CacheStore:
    """The cache boundary: admission under the device budget, lookup across tiers, write-back, eviction."""

    def __init__(self, *, new_cache: NewCache, offloader: Offloader, layout: CacheLayout,
                 model_key: str, device_budget_bytes: int, host_budget_bytes: int, enabled: bool = True,
                 policy: EvictionPolicy | None = None, ttl_s: float | None = None,
                 remote: RemoteCaches | None = None, clock: Callable[[], float] = time.monotonic,
                 on_copy: CopyObserver | None = None, faults: FaultPoints | None = None,
                 host_kv_dtype: KVDtype = "same", remote_kv_dtype: KVDtype = "same",
                 layer_windows: Sequence[int | None] = (), min_shared_tokens: int = UNIT, always_fetch: bool = False):
        self.enabled = enabled
        self.host_kv_dtype, self.remote_kv_dtype = host_kv_dtype, remote_kv_dtype
        self.cost = CostModel(remote.throughput if remote else Throughput(), always_fetch)
        self.layout = layout
        self.layer_windows = tuple(layer_windows) or (None,) * layout.layers  # per layer: sliding window or None
        self.model_key = model_key
        self.faults = faults or FaultPoints()
        self.ttl_s = ttl_s
        self.new_cache = new_cache
        self.offloader = offloader
        self._clock = clock
        notes = SessionNotes(clock)
        device = DeviceTier(device_budget_bytes, policy or ConnectedLRUPolicy(notes.kept), clock)
        host = HostTier(host_budget_bytes, HostBufferPool(pinned=offloader.pins_memory), clock, notes.kept)
        self.tiers = CacheTiers(
            device, host, SharedSegments(device, model_key, layout),
            TierMoves(host, offloader, new_cache, layout, model_key, host_kv_dtype, self.faults), notes, remote,
            RemoteMoves(remote, offloader, new_cache, layout, model_key, remote_kv_dtype) if remote else None,
            on_copy or (lambda direction, tier, seconds: None))
        # A system prompt shorter than this is copied into each session that uses it, from a session's cache that
        # holds it (`_prompt_copies`: prompt key -> the session and its cache, weakly: a pointer, not a holder;
        # running or not, resident or released), rather than attended as a segment (faster at every step when short).
        self.min_shared_tokens = min_shared_tokens
        self._prompt_copies: LRUCache[str, tuple[str, weakref.ref[CacheEntry]]] = LRUCache(REMEMBERED_SESSIONS)
        self._turns: dict[str, object] = {}  # session id -> its running turn, from admit to put or abandon

    # The tiers' parts, which the engine's housekeeping, the metrics and the tests read (the tiers hold them).

    @property
    def device(self) -> DeviceTier:
        return self.tiers.device

    @property
    def host(self) -> HostTier:
        return self.tiers.host

    @property
    def remote(self) -> RemoteCaches | None:
        """Redis (`--remote-kv`), or None."""
        return self.tiers.remote

    @property
    def notes(self) -> SessionNotes:
        return self.tiers.notes

    @property
    def segments(self) -> SharedSegments:
        return self.tiers.segments

    @property
    def counters(self) -> Counter[str]:
        return self.tiers.counters

    def owner_of(self, key: str) -> str | None:
        """Whose caches a tier's key belongs to: a segment's, or a session's as its last turn said."""
        return self.tiers.owner_of(key)

    @property
    def on_copy(self) -> CopyObserver:
        """Told of every restore and offload (direction, tier, seconds): for latency metrics."""
        return self.tiers.on_copy

    @on_copy.setter
    def on_copy(self, observer: CopyObserver) -> None:
        self.tiers.on_copy = observer

    # ##### Public API #####

    def admit(self, session_id: str, turn: object, nbytes: int, alone: bool = False) -> bool:
        """Start `turn` (any object that stands for it) of the session: from now until its write-back
        (`put`) or `abandon`, its cache counts as `nbytes` (what it may reach) against the device
        budget, and no other turn may have it (`SessionRunning`). Evicts idle caches to make room.
        When even evicting every idle cache is not enough, the turn is not admitted (False: wait for a
        running turn to finish), unless it is `alone`, with no other turn running to wait for: then it
        runs over the budget, and its cache leaves the device at write-back."""
        if self.tiers.device.is_running(session_id):
            raise SessionRunning(f"session {session_id} is already running a turn")
        if not self.tiers.admit(session_id, nbytes, alone):
            return False
        self._turns[session_id] = turn
        return True

    def remote_request(self, query: CacheQuery) -> FetchRequest | None:
        """What a turn should ask Redis for before its lookup, if anything: the session's copy there, when this
        worker has none as current as the turn (`session_version`; a session with no completed turn has nothing
        in Redis worth a round trip), and Redis answers. Names, by their ids, what the device holds that a fetch
        may keep. No call to Redis here: the fetch runs on the remote tier's threads (`start_fetch`)."""
        tiers, session_id, version = self.tiers, query.session_id, query.session_version
        if tiers.remote is None or not self.enabled or version == 0 or not tiers.remote.reachable:
            return None
        own = tiers.newest_copy(session_id)
        if own is not None and own.session_version >= version:
            return None
        tiers.notes.remember_owner(session_id, query.owner, query.prefix_len)
        # (the segment checked now, and brought back from the host tier if it must: what the fetch keeps is sound)
        segment = self._segment_for(query.prompt_ids, query.prefix_len, query.owner) if own is None else None
        return tiers.remote_moves.request(session_id, version, tiers.notes.scope_of(session_id), own, segment)

    def start_fetch(self, request: FetchRequest, prompt_tokens: int,
                    done: Callable[[], None] = lambda: None) -> RemoteFetch:
        """Fetch what `request` asks for on the remote tier's threads; `done` is called (on one of them) when it has
        finished. The turn waits for it at most as long as recomputing its `prompt_tokens` is estimated to take."""
        return self.tiers.remote_moves.start(request, prompt_tokens, self.cost, done)

    def lookup(self, query: CacheQuery, turn: object | None = None, fetch: RemoteFetch | None = None) -> CacheLookup:
        """Find the session's cache (device, host, then what `fetch` brought from Redis), check it, crop it to what
        the prompt shares with it, and hand it to `turn`, which `admit` admitted (a lookup for a turn not admitted
        admits it as it goes). Raises `SessionRunning` while another turn of the session runs: a
        running cache is never handed to a second turn. Without a cache, start from the shared prefix
        of the first `prefix_len` prompt ids when the owner shared it. A cache older than `session_version` is
        stale. The last prompt token is always left to feed: its logits pick the first reply token."""
        session_id, prompt_ids = query.session_id, query.prompt_ids
        turn = object() if turn is None else turn
        if self._turns.get(session_id) is not turn:
            self.admit(session_id, turn, 0, alone=True)
        if not self.enabled:
            return CacheLookup("miss", 0, miss_reason="disabled")
        self.tiers.notes.remember_owner(session_id, query.owner, query.prefix_len)
        # Another worker completed turns of this session since this worker's copy was written: Redis, which that
        # worker wrote, may hold the newest, which continues this copy (or else this copy is of no use).
        stale = (own := self.tiers.newest_copy(session_id)) is not None and own.session_version < query.session_version
        if stale and self.tiers.remote is None:
            self.tiers.discard_copies(session_id)
        found = self._on_device(session_id)
        if isinstance(found, _Found) and found.entry is None and session_id in self.tiers.host:
            found = self._from_host(session_id)
        decision = None
        if isinstance(found, _Found) and fetch is not None and (found.entry is None or stale):
            found, decision = self._from_redis(query, fetch, found)
        if isinstance(found, CacheLookup):
            return found  # a corrupt copy, cleared
        if stale and found.source != "remote":
            self.tiers.discard_copies(session_id)
            return CacheLookup("miss", 0, miss_reason="stale", remote=decision)
        if found.entry is None:
            return dataclasses.replace(self._start_from_prefix(query), remote=decision)
        return self._resume(session_id, found, prompt_ids, decision)

    def _on_device(self, session_id: str) -> _Found | CacheLookup:
        """The session's resident cache (None: not resident), checked."""
        entry = self.tiers.device.get(session_id)
        if entry is not None and (failed := self.tiers.check_resident(session_id, entry)):
            return self.report_corruption(session_id, failed)
        return _Found(entry, "device")

    def _from_host(self, session_id: str) -> _Found | CacheLookup:
        """The session's offloaded cache copied back into place, up to its last good copy (None: the segment it
        starts with is gone, and it was dropped)."""
        entry, cleared = self.tiers.restore(session_id, for_turn=True)
        if cleared and entry is None:
            return self.report_corruption(session_id, cleared)
        self.tiers.count_corruption(cleared)  # (a later copy failed: the turn recomputes from the last good one)
        return _Found(entry, "host", cleared)

    def _from_redis(self, query: CacheQuery, fetch: RemoteFetch, found: _Found
                    ) -> tuple[_Found | CacheLookup, RemoteDecision | None]:
        """What the fetch brought from Redis, copied into place after what the device holds (the session's older
        copy or its system prompt's segment) up to its last good chunk; and the fetch's decision."""
        outcome = fetch.outcome()
        decision = outcome.decision
        self.tiers.counters.update(outcome.counters)
        if decision is not None:
            self.tiers.counters[f"remote_decisions_{decision.choice}"] += 1
        if outcome.header is None or decision.choice != "fetch":
            return found, decision
        session_id, prompt_ids, prefix_len = query.session_id, query.prompt_ids, query.prefix_len
        held = found.entry or self._segment_for(prompt_ids, prefix_len, query.owner)
        fetched = self.tiers.adopt(session_id, outcome, held)
        if outcome.failed and fetched is None:
            return self.report_corruption(session_id, outcome.failed, outcome.header.session_version), decision
        self.tiers.count_corruption(outcome.failed)  # (a chunk failed: the turn recomputes from the last good one)
        if fetched is None:
            return found, decision
        self.tiers.share_system_prompt(fetched, prompt_ids, prefix_len, query.owner, self.min_shared_tokens)
        return _Found(fetched, "remote", outcome.failed), decision

    def _resume(self, session_id: str, found: _Found, prompt_ids: Sequence[int],
                decision: RemoteDecision | None) -> CacheLookup:
        """The cache cropped to what the prompt shares with it, leaving the last prompt token to feed."""
        entry = found.entry
        reusable = min(common_prefix_length(entry.token_ids, prompt_ids), len(prompt_ids) - 1)
        if reusable <= 0:
            self.drop(session_id, entry.session_version)  # nothing in it is of use, in any tier
            return CacheLookup("miss", 0, miss_reason="drift")
        entry.crop(reusable)
        self.tiers.cropped(session_id, reusable)
        entry.checksum = None  # the turn changes it; write-back takes a new one
        return CacheLookup(found.source, reusable, entry.acquire(), cleared=found.cleared, remote=decision)

    def put(self, session_id: str, entry: CacheEntry, session_version: int = 0,
            keep_for_s: float | None = None) -> None:
        """Write a session's cache back after its turn, with the fingerprint and checksum that its next
        reuse verifies; it becomes evictable again. `session_version` counts the completed turns the
        cache includes; `keep_for_s` (a cache breakpoint's ttl) keeps it resident that long ahead of plain LRU."""
        self._end_turn(session_id)
        tiers = self.tiers
        if keep_for_s:
            tiers.notes.keep(session_id, keep_for_s)
        if not self.enabled or entry.num_tokens == 0 or tiers.segments.missing(entry) is not None:
            self.drop(session_id)  # (a segment it starts with was dropped while it ran: it recomputes)
            return
        tiers.device.discard(session_id)  # (the turn still holds `entry`: the tier takes it back below)
        tiers.notes.found(session_id)
        if isinstance(entry.cache, ArenaCache):
            entry.cache.fit()  # its region shrinks to what it holds: the rest is free for others
        entry.fingerprint = fingerprint(entry, self.model_key, session_id, self.layout)
        entry.checksum = checksum(entry.tensors())
        entry.session_version = session_version
        base = tiers.continued_copy(session_id, entry)
        if base is not None:  # that offload copies only the positions after `base`: they alone are checked then
            own = len(base.token_ids) - entry.prefix_tokens
            entry.suffix_checksum = (len(base.token_ids), checksum([(k[..., own:, :], v[..., own:, :])
                                                                   for k, v in entry.tensors()]), entry.checksum)
        tiers.make_room(entry.nbytes())
        tiers.place(session_id, entry)
        if tiers.remote is not None:
            tiers.share_remotely(session_id, entry)
        if isinstance(entry.cache, TemporaryCache) or tiers.device.used_bytes() > tiers.device.budget_bytes:
            tiers.offload(session_id)  # longer than the whole arena, or alone larger than the budget

    def release(self, session_id: str) -> None:
        """The session's turn ended without touching its cache (cancelled before its lookup)."""
        self._end_turn(session_id)

    def abandon(self, session_id: str) -> None:
        """The session's turn failed: drop its cache on this worker (it may be half-written) and end the turn's
        reservation of the budget. Its copy in Redis, written by an earlier turn that completed, stays: the
        session's next turn (on any worker) may still need it, and it is checked on every fetch."""
        self.drop(session_id)
        self._end_turn(session_id)

    def put_prefix(self, entry: CacheEntry, owner: str | None = None, pinned: bool = False,
                   source: str | None = None) -> bool:
        """Share `entry`'s tokens (a system prompt just prefilled alone, in session `source`'s cache) with every
        new session of `owner` (another never sees it, not even in timing) whose prompt begins with its
        ids: as a segment that they and `entry` start with, nothing copied; or, for a prompt shorter than
        `min_shared_tokens`, by copying it from `source`'s cache. `pinned` (a warm prompt): always a segment,
        never evicted, and found by every owner. Whether `entry` now starts with a segment."""
        if not self.enabled:
            return False
        key = segment_key(entry.token_ids, None if pinned else owner)
        if not pinned and entry.own_tokens // UNIT * UNIT < self.min_shared_tokens:
            if source is not None:
                self._prompt_copies[key] = (source, weakref.ref(entry))
            return False
        return self.tiers.segments.share(entry, key, pinned, owner=None if pinned else owner) is not None

    def fork(self, source: str, target: str, prompt_ids: Sequence[int]) -> int:
        """Start `target`'s cache from the part of `source`'s device-resident cache that `prompt_ids` begins with
        (`branches.fork`). Returns the positions it holds."""
        return fork(self.tiers, self.new_cache, source, target, prompt_ids) if self.enabled else 0

    def touch(self, session_id: str, connected: bool) -> None:
        """Record whether a client is connected to the session: connected caches are evicted last."""
        self.tiers.connected(session_id, connected)

    def prefetch(self, session_id: str) -> bool:
        """Bring a session's cache from the host tier back to the device ahead of its turn. A hint:
        it never evicts a running cache, and does nothing if the cache is not in the host tier."""
        tiers = self.tiers
        if not self.enabled or session_id not in tiers.host or session_id in tiers.device:
            return False
        if not tiers.device.can_fit(tiers.host.get(session_id).device_nbytes):
            return False
        try:
            entry, failed = self.tiers.restore(session_id)
        except ArenaFull:
            return False  # no room on the device after all; it stays in the host tier
        if failed and entry is None:
            self.tiers.report_corruption(session_id, failed)
        self.tiers.count_corruption(failed if entry is not None else ())
        return entry is not None

    def report_corruption(self, session_id: str, failed: tuple[Check, ...],
                          remote_up_to: int | None = None) -> CacheLookup:
        """A check failed: clear the session's cache (or the shared segment's, and every resident cache that
        starts with it) on this worker, and in Redis up to version `remote_up_to` when that copy is suspect too;
        its turn recomputes."""
        self.tiers.report_corruption(session_id, failed, remote_up_to)
        return CacheLookup("miss", 0, miss_reason="corrupt", cleared=failed)

    def drop(self, session_id: str, remote_up_to: int | None = None) -> None:
        """Drop a session's cache (or a shared segment, with every resident cache that starts with it) on this
        worker, and in Redis when its copy there is of version `remote_up_to` or older (`CacheTiers.drop`)."""
        self.tiers.drop(session_id, remote_up_to)

    def forget(self, session_id: str) -> None:
        """The session is closed: drop its cache (in Redis too, whatever its version) and everything known about
        it."""
        self.drop(session_id, EVERY_VERSION)
        self.tiers.notes.forget(session_id)

    def evict_one(self) -> bool:
        """Evict the idle cache the policy ranks lowest (to free a region of the arena); False if none is idle."""
        return self.tiers.evict_one()

    def evict_idle(self) -> int:
        """Offload every cache that is not running (used when the device runs out of memory); shared segments
        go once nothing resident starts with them."""
        return self.tiers.evict_idle()

    def expire(self) -> list[str]:
        """Drop the caches of disconnected sessions idle for longer than the TTL (not those kept resident for a
        cache breakpoint, until its own ttl ends)."""
        return self.tiers.expire(self._clock() - self.ttl_s) if self.ttl_s is not None else []

    def stats(self) -> dict[str, int]:
        """Occupancy and cumulative counters, for metrics and `/v1/stats`."""
        return store_stats(self.tiers, self.layer_windows)

    # ##### Helpers #####

    def _start_from_prefix(self, query: CacheQuery) -> CacheLookup:
        """A new cache that starts with the resident segment holding the prompt's system prompt: nothing is
        copied."""
        session_id, prompt_ids, prefix_len = query.session_id, query.prompt_ids, query.prefix_len
        reason: MissReason = "evicted" if self.tiers.notes.was_lost(session_id) else "new"
        if not 0 < prefix_len < len(prompt_ids):
            return CacheLookup("miss", 0, miss_reason=reason)
        segment = self._segment_for(prompt_ids, prefix_len, query.owner)
        if segment is None:
            return self._copy_from_session(session_id, prompt_ids[:prefix_len], query.owner) or \
                CacheLookup("miss", 0, miss_reason=reason)
        entry = CacheEntry(self.new_cache(prefix_len), list(segment.token_ids))
        chain.attach(entry.cache, segment.cache)
        self.tiers.place(session_id, entry)
        return CacheLookup("prefix", segment.num_tokens, entry)

    def _copy_from_session(self, session_id: str, prompt: Sequence[int], owner: str | None) -> CacheLookup | None:
        """A new cache holding a copy of a short system prompt, from the cache of the session that prefilled it
        (checked first, unless its turn is still running: then its write-back checks it)."""
        holder, source = self._prompt_copies.get(segment_key(prompt, owner), (None, lambda: None))
        source = source() if holder != session_id else None
        if source is None or source.released or source.token_ids[:len(prompt)] != list(prompt):
            return None
        if source.checksum is not None and (failed := self.tiers.check_resident(holder, source)):
            self.report_corruption(holder, failed)
            return None
        try:
            entry = source.clone(self.new_cache, len(prompt))
        except ArenaFull:
            return None
        self.tiers.make_room(self.tiers.device.extra_bytes(session_id, entry.nbytes()), keep=holder)
        self.tiers.place(session_id, entry)
        return CacheLookup("prefix", len(prompt), entry)

    def _segment_for(self, prompt_ids: Sequence[int], prefix_len: int, owner: str | None) -> CacheEntry | None:
        """The checked segment holding the prompt's first `prefix_len` ids: the owner's own, or a warm prompt
        (pinned, shared by every owner)."""
        if prefix_len <= 0 or not self.enabled:
            return None
        ids = list(prompt_ids[:prefix_len])
        warm = segment_key(ids, None)
        return self.tiers.find_segment(warm if self.tiers.device.is_pinned(warm) else segment_key(ids, owner), ids)

    def _end_turn(self, session_id: str) -> None:
        self.tiers.device.unreserve(session_id)
        self._turns.pop(session_id, None)


