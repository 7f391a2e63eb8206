"""The cache boundary. A turn asks what it may reuse and gets one `CacheLookup` back; everything
about tiers, eviction, offload and sharing stays behind this object.

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

import cache_store.chain as chain
from cache_store.arena import UNIT, ArenaCache, ArenaFull, TemporaryCache
from cache_store.cost_model import CostModel, RemoteDecision, Throughput
from cache_store.device_tier import DeviceTier
from cache_store.entry import CacheEntry, NewCache
from cache_store.eviction import EvictionPolicy
from cache_store.failure_log import log_failure
from cache_store.host_pool import HostBufferPool
from cache_store.host_tier import HostTier
from cache_store.identity import CacheLayout
from cache_store.integrity import Check, check_identity, check_tensors, checksum, fingerprint
from cache_store.lookup import (
    CacheLookup,
    CacheSource,
    CopyObserver,
    MissReason,
    RemoteCaches,
    SessionRunning,
    common_prefix_length,
)
from cache_store.offload import Offloader
from cache_store.quantize import KVDtype
from cache_store.remote_moves import FetchRequest, HeldIds, RemoteFetch, RemoteMoves, fetch_copy
from cache_store.segments import SharedSegments, is_segment, segment_key
from cache_store.sizing import layer_tokens_needed
from cache_store.stage_faults import FaultPoints
from cache_store.tier_moves import TierMoves

log = logging.getLogger(__name__)
_REMEMBERED_LOSSES = 100_000
_UNKNOWN = object()


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
        self.remote = remote
        self.cost = CostModel(remote.throughput if remote else Throughput(), always_fetch)
        self.layout = layout
        self.layer_windows = tuple(layer_windows) or (None,) * layout.layers  # per layer: sliding window or None
        self.model_key = model_key
        self.device = DeviceTier(device_budget_bytes, policy, clock)
        self.segments = SharedSegments(self.device, model_key, layout)
        self.host = HostTier(host_budget_bytes, HostBufferPool(pinned=offloader.pins_memory), clock)
        self.faults = faults or FaultPoints()
        self.ttl_s = ttl_s
        self.counters: Counter[str] = Counter()
        self.new_cache = new_cache
        self.offloader = offloader
        self._clock = clock
        self.on_copy = on_copy or (lambda direction, tier, seconds: None)  # for latency metrics
        self.connected: set[str] = set()  # sessions with a client: evicted last
        self._moves = TierMoves(self)
        self._remote_moves = RemoteMoves(self)
        self._lost: LRUCache[str, None] = LRUCache(_REMEMBERED_LOSSES)  # sessions whose cache was dropped
        # A system prompt shorter than this is copied into each session that uses it, from a session's cache that
        # holds it (`_holders`: prompt key -> the session and its cache, weakly: running or not, resident or gone),
        # rather than attended as a segment (faster at every step when short).
        self.min_shared_tokens = min_shared_tokens
        self._holders: LRUCache[str, tuple[str, weakref.ref[CacheEntry]]] = LRUCache(_REMEMBERED_LOSSES)
        self._turns: dict[str, object] = {}  # session id -> its running turn, from admit to put or abandon
        # session id -> its owner and its system prompt's length, as its turns said
        self._scopes: LRUCache[str, tuple[str | None, int]] = LRUCache(_REMEMBERED_LOSSES)

    # ##### Public API #####

    def admit(self, session_id: str, turn: object, nbytes: int, alone: bool = False) -> bool:
        """Start `turn` (any object that stands for it) of the session: from now until its write-back
        (`put`) or `abandon`, its cache counts as `nbytes` (what it may reach) against the device
        budget, and no other turn may have it (`SessionRunning`). Evicts idle caches to make room.
        When even evicting every idle cache is not enough, the turn is not admitted (False: wait for a
        running turn to finish), unless it is `alone`, with no other turn running to wait for: then it
        runs over the budget, and its cache leaves the device at write-back."""
        if self.device.is_running(session_id):
            raise SessionRunning(f"session {session_id} is already running a turn")
        victims, fits = self.device.plan_room(self.device.extra_bytes(session_id, nbytes), keep=session_id)
        if not fits and not alone:
            return False
        for key in victims:
            self._evict(key)
        while not fits and (rest := [k for k in self.device if k != session_id and self.device.is_evictable(k)]):
            for key in rest:  # alone over the budget: every idle cache goes (segments once nothing starts with them)
                self._evict(key)
        self.device.reserve(session_id, nbytes)
        self._turns[session_id] = turn
        return True

    def remote_request(self, session_id: str, prompt_ids: Sequence[int], prefix_len: int = 0,
                       session_version: int = 0, scope: str | None = None) -> FetchRequest | None:
        """What a turn should ask Redis for before its lookup, if anything: the session's copy there, when this
        worker has none as current as the turn (`session_version`; a session with no completed turn has nothing
        in Redis worth a round trip), and Redis answers. Names, by their ids, what the device holds that a fetch
        may keep. No call to Redis here: the fetch runs on the remote tier's threads (`start_fetch`)."""
        if self.remote is None or not self.enabled or session_version == 0 or not self.remote.reachable:
            return None
        own = self.device.peek(session_id) or self.host.get(session_id)
        if own is not None and own.session_version >= session_version:
            return None
        self._remember_scope(session_id, scope, prefix_len)
        if own is not None:
            held = self._remote_moves.held_ids(own) if isinstance(own, CacheEntry) else \
                HeldIds(tuple(own.token_ids), False, own.prefix_tokens)
        else:  # (checked now, and brought back from the host tier if it must: what the fetch keeps is sound)
            held = self._remote_moves.held_ids(self._segment_for(prompt_ids, prefix_len, scope))
        return FetchRequest(session_id, session_version, self.scope_of(session_id), self.model_key, self.layout,
                            self.remote_kv_dtype, held, pin=self.offloader.pins_memory)

    def start_fetch(self, request: FetchRequest, prompt_tokens: int,
                    done: Callable[[], None] = lambda: None) -> RemoteFetch:
        """Fetch what `request` asks for on the remote tier's threads; `done` is called (on one of them) when it has
        finished. The turn waits for it at most as long as recomputing its `prompt_tokens` is estimated to take."""
        job = self.remote.submit(lambda: fetch_copy(request, self.remote, self.cost))
        job.add_done_callback(lambda _: done())
        patience = self.cost.patience_s(prompt_tokens, self.remote.timeout_s)
        return RemoteFetch(job, time.monotonic(), patience, self.cost.prefill_s(prompt_tokens))

    def lookup(self, session_id: str, prompt_ids: Sequence[int], prefix_len: int = 0,
               session_version: int = 0, turn: object | None = None, scope: str | None = None,
               fetch: RemoteFetch | None = None) -> CacheLookup:
        """Find the session's cache (device, host, then what `fetch` brought from Redis), check it, crop it to what
        the prompt shares with it, and hand it to `turn`, which `admit` admitted (a lookup for a turn not admitted
        admits it as it goes). Raises `SessionRunning` while another turn of the session runs: a
        running cache is never handed to a second turn. Without a cache, start from the shared prefix
        of the first `prefix_len` prompt ids when `scope` (the owner) shared it. A cache older than `session_version` is
        stale. The last prompt token is always left to feed: its logits pick the first reply token."""
        turn = object() if turn is None else turn
        if self._turns.get(session_id) is not turn:
            self.admit(session_id, turn, 0, alone=True)
        if not self.enabled:
            return CacheLookup("miss", 0, miss_reason="disabled")
        self._remember_scope(session_id, scope, prefix_len)
        # Another worker completed turns of this session since this worker's copy was written: Redis, which that
        # worker wrote, may hold the newest, which continues this copy (or else this copy is of no use).
        stale = self._older_than(session_id, session_version)
        if stale and self.remote is None:
            self._discard_copies(session_id)
        found = self._on_device(session_id)
        if isinstance(found, _Found) and found.entry is None and session_id in self.host:
            found = self._from_host(session_id)
        decision = None
        if isinstance(found, _Found) and fetch is not None and (found.entry is None or stale):
            found, decision = self._from_redis(session_id, fetch, found, prompt_ids, prefix_len, scope)
        if isinstance(found, CacheLookup):
            return found  # a corrupt copy, cleared
        if stale and found.source != "remote":
            self._discard_copies(session_id)
            return CacheLookup("miss", 0, miss_reason="stale", remote=decision)
        if found.entry is None:
            return dataclasses.replace(self._start_from_prefix(session_id, prompt_ids, prefix_len, scope),
                                       remote=decision)
        return self._resume(session_id, found, prompt_ids, decision)

    def _on_device(self, session_id: str) -> _Found | CacheLookup:
        """The session's resident cache (None: not resident), checked."""
        entry = self.device.get(session_id)
        if entry is not None and (failed := self._check_resident(session_id, entry)):
            return self.report_corruption(session_id, failed)
        return _Found(entry, "device")

    def _from_host(self, session_id: str) -> _Found | CacheLookup:
        """The session's offloaded cache copied back into place, up to its last good copy (None: the segment it
        starts with is gone, and it was dropped)."""
        entry, cleared = self._moves.restore(session_id, for_turn=True)
        if cleared and entry is None:
            return self.report_corruption(session_id, cleared)
        self._count_corruption(cleared)  # (a later copy failed: the turn recomputes from the last good one)
        return _Found(entry, "host", cleared)

    def _from_redis(self, session_id: str, fetch: RemoteFetch, found: _Found, prompt_ids: Sequence[int],
                    prefix_len: int, scope: str | None) -> tuple[_Found | CacheLookup, RemoteDecision | None]:
        """What the fetch brought from Redis, copied into place after what the device holds (the session's older
        copy or its system prompt's segment) up to its last good chunk; and the fetch's decision."""
        outcome = fetch.outcome()
        decision = outcome.decision
        self.counters.update(outcome.counters)
        if decision is not None:
            self.counters[f"remote_decisions_{decision.choice}"] += 1
        if outcome.header is None or decision.choice != "fetch":
            return found, decision
        held = found.entry or self._segment_for(prompt_ids, prefix_len, scope)
        fetched = self._remote_moves.adopt(session_id, outcome, held)
        if outcome.failed and fetched is None:
            return self.report_corruption(session_id, outcome.failed), decision
        self._count_corruption(outcome.failed)  # (a chunk failed: the turn recomputes from the last good one)
        if fetched is None:
            return found, decision
        self._remote_moves.share_system_prompt(session_id, fetched, prompt_ids, prefix_len, scope)
        return _Found(fetched, "remote", outcome.failed), decision

    def _resume(self, session_id: str, found: _Found, prompt_ids: Sequence[int],
                decision: RemoteDecision | None) -> CacheLookup:
        """The cache cropped to what the prompt shares with it, leaving the last prompt token to feed."""
        entry = found.entry
        reusable = min(common_prefix_length(entry.token_ids, prompt_ids), len(prompt_ids) - 1)
        if reusable <= 0:
            self.drop(session_id)  # nothing in it is of use, in any tier
            return CacheLookup("miss", 0, miss_reason="drift")
        entry.crop(reusable)
        entry.checksum = None  # the turn changes it; write-back takes a new one
        if (kept := self.host.get(session_id)) is not None and len(kept.token_ids) > reusable:
            self.host.discard(session_id)  # positions it holds are computed again: its next offload is whole
        return CacheLookup(found.source, reusable, entry, cleared=found.cleared, remote=decision)

    def _discard_copies(self, session_id: str) -> None:
        """A stale session's copies on the device and the host are of no use."""
        self.device.pop(session_id)
        self.host.discard(session_id)

    def put(self, session_id: str, entry: CacheEntry, session_version: int = 0) -> None:
        """Write a session's cache back after its turn, with the fingerprint and checksum that its next
        reuse verifies; it becomes evictable again. `session_version` counts the completed turns the
        cache includes."""
        self._end_turn(session_id)
        if not self.enabled or entry.num_tokens == 0 or self.segments.missing(entry) is not None:
            self.drop(session_id)  # (a segment it starts with was dropped while it ran: it recomputes)
            return
        self.device.pop(session_id)
        self._lost.pop(session_id, None)
        if isinstance(entry.cache, ArenaCache):
            entry.cache.fit()  # its region shrinks to what it holds: the rest is free for others
        entry.fingerprint = fingerprint(entry, self.model_key, session_id, self.layout)
        entry.checksum = checksum(entry.tensors())
        entry.session_version = session_version
        kept = self.host.get(session_id)  # (restored from the host tier: its next offload continues that chain)
        _, base = self._moves.offload_base(session_id, entry, kept) if kept is not None else ([], None)
        if base is not None:  # that offload copies only the positions after `base`: they alone are checked then
            own = len(base.token_ids) - entry.prefix_tokens
            entry.suffix_checksum = (len(base.token_ids), checksum([(k[..., own:, :], v[..., own:, :])
                                                                   for k, v in entry.tensors()]), entry.checksum)
        self.make_room(entry.nbytes())
        self.device.put(session_id, entry, connected=session_id in self.connected)
        if self.remote is not None:
            try:
                self._remote_moves.share(session_id, entry)
            except Exception as error:  # the turn is done and its cache is here: only other workers go without it
                log_failure(log, error, "session %s: snapshotting its cache for Redis failed; Redis keeps the copy "
                                        "before", session_id)
                self.counters["remote_snapshot_failures"] += 1
        if isinstance(entry.cache, TemporaryCache) or self.device.used_bytes() > self.device.budget_bytes:
            self._moves.offload(session_id)  # longer than the whole arena, or alone larger than the budget

    def release(self, session_id: str) -> None:
        """The session's turn ended without touching its cache (cancelled before its lookup)."""
        self._end_turn(session_id)

    def abandon(self, session_id: str) -> None:
        """The session's turn failed: drop its cache from every tier (it may be half-written) and end
        the turn's hold on the budget."""
        self.drop(session_id)
        self._end_turn(session_id)

    def put_prefix(self, entry: CacheEntry, scope: str | None = None, pinned: bool = False,
                   holder: str | None = None) -> bool:
        """Share `entry`'s tokens (a system prompt just prefilled alone, in session `holder`'s cache) with every
        new session of `scope` (an owner: another never sees it, not even in timing) whose prompt begins with its
        ids: as a segment that they and `entry` start with, nothing copied; or, for a prompt shorter than
        `min_shared_tokens`, by copying it from `holder`'s cache. `pinned` (a warm prompt): always a segment,
        never evicted, and found by every owner. Whether `entry` now starts with a segment."""
        if not self.enabled:
            return False
        key = segment_key(entry.token_ids, None if pinned else scope)
        if not pinned and entry.own_tokens // UNIT * UNIT < self.min_shared_tokens:
            if holder is not None:
                self._holders[key] = (holder, weakref.ref(entry))
            return False
        return self.segments.share(entry, key, pinned) is not None

    def fork(self, source: str, target: str, prompt_ids: Sequence[int]) -> int:
        """Start `target`'s cache from the part of `source`'s device-resident cache that `prompt_ids` begins
        with (a branch of a conversation: a regenerated reply, an edited message, a second tab): it starts
        with the same shared segments, and the rest of that part is copied. The source, running or not, is
        left as it is. Returns the positions it holds."""
        entry = self.device.get(source) if self.enabled and target not in self.device else None
        if entry is None or (entry.checksum is not None and self._check_resident(source, entry)):
            return 0  # (a running source is checked at its write-back)
        shared = min(common_prefix_length(entry.token_ids, prompt_ids), len(prompt_ids) - 1)
        if shared <= 0:
            return 0
        self._share_history(source, entry, shared)
        try:
            copy = entry.clone(self.new_cache, shared)
        except ArenaFull:
            return 0  # no room for a copy now: the branch prefills from scratch
        copy.fingerprint = fingerprint(copy, self.model_key, target, self.layout)
        copy.checksum = checksum(copy.tensors())
        self.make_room(copy.nbytes(), keep=source)
        self.device.put(target, copy, connected=target in self.connected)
        return shared

    def _share_history(self, source: str, entry: CacheEntry, shared: int) -> None:
        """Make the whole units of the history a branch shares with `source` (beyond the segments `source`
        starts with) a segment of their own, which both start with: a branch of a conversation that itself
        started from a shared prompt, one level deeper. Nothing is copied; the source's own checksum is taken
        again over what it keeps."""
        if not isinstance(entry.cache, ArenaCache):
            return
        tokens = (shared - entry.prefix_tokens) // UNIT * UNIT
        if tokens <= 0:
            return
        token_ids = entry.token_ids[:entry.prefix_tokens + tokens]
        key = segment_key(token_ids, f"branch:{source}")
        if key in self.device:
            return
        segment = CacheEntry(chain.split(entry.cache, tokens), token_ids)
        segment.cache.segment_key = key
        self.segments.stamp(key, segment)
        self.device.put(key, segment)
        if entry.checksum is not None:
            entry.checksum = checksum(entry.tensors())

    def touch(self, session_id: str, connected: bool) -> None:
        """Record whether a client is connected to the session: connected caches are evicted last."""
        (self.connected.add if connected else self.connected.discard)(session_id)
        if (residency := self.device.residency(session_id)) is not None:
            residency.connected = connected

    def prefetch(self, session_id: str) -> bool:
        """Bring a session's cache from the host tier back to the device ahead of its turn. A hint:
        it never evicts a running cache, and does nothing if the cache is not in the host tier."""
        if not self.enabled or session_id not in self.host or session_id in self.device:
            return False
        if not self.device.can_fit(self.host.get(session_id).device_nbytes):
            return False
        try:
            entry, failed = self._moves.restore(session_id)
        except ArenaFull:
            return False  # no room on the device after all; it stays in the host tier
        if failed and entry is None:
            self.report_corruption(session_id, failed)
        self._count_corruption(failed if entry is not None else ())
        return entry is not None

    def report_corruption(self, session_id: str, failed: tuple[Check, ...]) -> CacheLookup:
        """A check failed: clear the session's cache (or the shared segment's, and every resident cache that
        starts with it) in every tier; its turn recomputes."""
        log.warning("%s: cache failed the %s check; cleared, recomputing",
                    f"shared segment {session_id}" if is_segment(session_id) else f"session {session_id}",
                    ", ".join(failed))
        self.drop(session_id)
        self._count_corruption(failed)
        return CacheLookup("miss", 0, miss_reason="corrupt", cleared=failed)

    def _count_corruption(self, failed: tuple[Check, ...]) -> None:
        for check in failed:
            self.counters[f"corrupt_{check}"] += 1

    def drop(self, session_id: str) -> None:
        """Drop a session's cache from every tier; its next turn recomputes. Dropping a shared segment drops
        every resident cache that starts with it (a cache that names it in a lower tier finds it again, or
        recomputes) and its host copy. A session's chunks in Redis stay for the sessions that share them (each is
        checked on every fetch, and deleted when it fails)."""
        if is_segment(session_id):
            for dependent in self.segments.drop(session_id):
                self.remember_loss(dependent)
        self.device.pop(session_id)
        self.host.discard(session_id)
        if self.remote is not None and not is_segment(session_id):
            self.remote.delete(session_id)

    def forget(self, session_id: str) -> None:
        """The session is closed: drop its cache and everything known about it."""
        self.drop(session_id)
        self._lost.pop(session_id, None)
        self._scopes.pop(session_id, None)
        self.connected.discard(session_id)

    def evict_one(self) -> bool:
        """Evict the idle cache the policy ranks lowest (to free a region of the arena); False if none is idle."""
        victims = sorted((self.device.residency(key) for key in self.device if self.device.is_evictable(key)),
                         key=self.device.policy.priority)
        if not victims:
            return False
        self._evict(victims[0].key)
        return True

    def evict_idle(self) -> int:
        """Offload every cache that is not running (used when the device runs out of memory); shared segments
        go once nothing resident starts with them."""
        moved = 0
        while victims := [key for key in self.device if self.device.is_evictable(key)]:
            for key in victims:
                self._evict(key)
            moved += len(victims)
        return moved

    def expire(self) -> list[str]:
        """Drop the caches of disconnected sessions idle for longer than the TTL."""
        if self.ttl_s is None:
            return []
        deadline = self._clock() - self.ttl_s
        expired = [key for key in self.device if not is_segment(key) and self._idle_since(key) < deadline]
        named = {self.host.get(key).prefix_key for key in self.host.keys()}  # segments that host entries start with
        expired += [key for key in self.host.keys()
                    if key not in self.connected and key not in named and self.host.put_at(key) < deadline]
        for key in expired:
            self.device.pop(key)
            self.host.discard(key)
            self.remember_loss(key)
            self.counters["expired"] += 1
        return expired

    def stats(self) -> dict[str, int]:
        """Occupancy and cumulative counters, for metrics and `/v1/stats`."""
        device_sessions = [key for key in self.device if not is_segment(key)]
        cached = {*device_sessions, *(key for key in self.host.keys() if not is_segment(key))}
        entries = [self.device.peek(key) for key in self.device]  # sessions' caches and shared segments
        layer_token_bytes = self.layout.token_bytes // self.layout.layers
        token_bytes = self.layout.token_bytes
        shared = self.segments.stats()
        stats = {
            "device_bytes": self.device.used_bytes(), "device_budget_bytes": self.device.budget_bytes,
            # the distinct keys and values resident caches hold (a shared segment once), the part of them their
            # layers' windows need, and what the sessions' caches would hold as private copies
            "device_kv_bytes": sum(entry.own_tokens for entry in entries) * token_bytes,
            "device_window_bytes": sum(layer_tokens_needed(self.layer_windows, entry.num_tokens)
                                       - layer_tokens_needed(self.layer_windows, entry.prefix_tokens)
                                       for entry in entries) * layer_token_bytes,
            "device_private_kv_bytes": shared["private_tokens"] * token_bytes,
            "device_reserved_bytes": self.device.reserved_bytes(), "device_sessions": len(device_sessions),
            "prefixes": shared["segments"], "segments_pinned": shared["segments_pinned"],
            "segment_users": shared["segment_users"], "shared_sessions": shared["shared_sessions"],
            "segment_bytes": shared["segment_tokens"] * token_bytes,
            "host_bytes": self.host.used_bytes(), "host_budget_bytes": self.host.budget_bytes,
            "host_free_bytes": self.host.pool.free_bytes, "host_segments": sum(map(is_segment, self.host.keys())),
            "host_sessions": len(self.host) - sum(map(is_segment, self.host.keys())), **self.host.chunk_stats(),
            "idle_sessions": len(cached - self.connected), **self.counters,
        }
        if self.remote is not None:
            stats["remote_bytes"], stats["remote_budget_bytes"] = self.remote.usage()
            stats["remote_read_errors"], stats["remote_write_errors"] = self.remote.errors, self.remote.write_errors
            stats.update({f"remote_{name}": value for name, value in self.remote.counters.items()})
            stats["remote_chunks_known"] = self.remote.chunks_known()
            stats.update({f"remote_{name}": value for name, value in self.remote.pending().items()})
            stats["remote_round_trip_ms"] = round(1000 * (self.remote.throughput.round_trip_s or 0.0), 3)
        return stats

    # ##### Helpers #####

    def _start_from_prefix(self, session_id: str, prompt_ids: Sequence[int], prefix_len: int,
                           scope: str | None) -> CacheLookup:
        """A new cache that starts with the resident segment holding the prompt's system prompt: nothing is
        copied."""
        reason: MissReason = "evicted" if session_id in self._lost else "new"
        if not 0 < prefix_len < len(prompt_ids):
            return CacheLookup("miss", 0, miss_reason=reason)
        segment = self._segment_for(prompt_ids, prefix_len, scope)
        if segment is None:
            return self._copy_from_holder(session_id, prompt_ids[:prefix_len], scope) or \
                CacheLookup("miss", 0, miss_reason=reason)
        entry = CacheEntry(self.new_cache(prefix_len), list(segment.token_ids))
        chain.attach(entry.cache, segment.cache)
        self.device.put(session_id, entry, connected=session_id in self.connected)
        return CacheLookup("prefix", segment.num_tokens, entry)

    def _copy_from_holder(self, session_id: str, prompt: Sequence[int], scope: str | None) -> CacheLookup | None:
        """A new cache holding a copy of a short system prompt, from the cache of the session that prefilled it
        (checked first, unless its turn is still running: then its write-back checks it)."""
        holder, source = self._holders.get(segment_key(prompt, scope), (None, lambda: None))
        source = source() if holder != session_id else None
        if source is None or source.token_ids[:len(prompt)] != list(prompt):
            return None
        if source.checksum is not None and (failed := self._check_resident(holder, source)):
            self.report_corruption(holder, failed)
            return None
        try:
            entry = source.clone(self.new_cache, len(prompt))
        except ArenaFull:
            return None
        self.make_room(self.device.extra_bytes(session_id, entry.nbytes()), keep=holder)
        self.device.put(session_id, entry, connected=session_id in self.connected)
        return CacheLookup("prefix", len(prompt), entry)

    def scope_of(self, session_id: str) -> str:
        """Whose chunks the session's cache is made of: its owner's (every owner's when the server has no keys);
        a session never looked up here (no owner known) has chunks of its own."""
        scope, _ = self._scopes.get(session_id, (_UNKNOWN, 0))
        return f"session:{session_id}" if scope is _UNKNOWN else f"owner:{scope or '*'}"

    def prompt_tokens(self, session_id: str) -> int:
        """The length of the session's system prompt, as its last turn said (0: none, or not known)."""
        return self._scopes.get(session_id, (None, 0))[1]

    def _remember_scope(self, session_id: str, scope: str | None, prefix_len: int) -> None:
        self._scopes[session_id] = (scope, prefix_len)

    def _segment_for(self, prompt_ids: Sequence[int], prefix_len: int, scope: str | None) -> CacheEntry | None:
        """The checked segment holding the prompt's first `prefix_len` ids: the owner's own, or a warm prompt
        (pinned, shared by every owner)."""
        if prefix_len <= 0 or not self.enabled:
            return None
        ids = list(prompt_ids[:prefix_len])
        warm = segment_key(ids, None)
        return self._moves.find_segment(warm if self.device.is_pinned(warm) else segment_key(ids, scope), ids)

    def _older_than(self, session_id: str, session_version: int) -> bool:
        entry = self.device.get(session_id) or self.host.get(session_id)
        return entry is not None and entry.session_version < session_version

    def _check_resident(self, owner: str, entry: CacheEntry) -> tuple[Check, ...]:
        """Every check of a device-resident cache, its checksum included, and of every shared segment it starts
        with: a cache is only ever reused with the bytes it was written back with. A failed segment is dropped
        with every cache that starts with it."""
        key, failed_segment = self.segments.check_chain(entry)
        if key is not None:
            if key in self.device:  # (counted once, as the session's corruption, by the caller)
                log.warning("shared segment %s failed the %s check; dropped", key, ", ".join(failed_segment))
                self.drop(key)
            return failed_segment
        failed = (check_identity(entry.fingerprint, self.model_key, owner, entry.token_ids, self.layout)
                  or check_tensors(entry.tensors(), entry.own_tokens, self.layout)
                  or (checksum(entry.tensors()) != entry.checksum and "checksum"))
        return (failed,) if failed else ()

    def make_room(self, need_bytes: int, keep: str | Sequence[str] = ()) -> None:
        """Evict, in the policy's order, what `need_bytes` more on the device need (never `keep`)."""
        for key in self.device.plan_room(need_bytes, keep=keep)[0]:
            if key in self.device:
                self._evict(key)

    def _evict(self, key: str) -> None:
        if is_segment(key) and (key in self.host
                                or not any(self.host.get(other).prefix_key == key for other in self.host.keys())):
            # A shared segment already in the host tier (it never changes), or that nothing there names: dropped
            # from the device without a copy.
            self.device.pop(key)
            self.counters["prefix_evictions"] += 1
            return
        self._moves.offload(key)

    def remember_loss(self, session_id: str) -> None:
        """The session's cache is gone from every tier: its next turn is an `evicted` miss."""
        self._lost[session_id] = None

    def _end_turn(self, session_id: str) -> None:
        self.device.unreserve(session_id)
        self._turns.pop(session_id, None)

    def _idle_since(self, key: str) -> float:
        residency = self.device.residency(key)
        return float("inf") if residency.running or residency.connected else residency.last_access


