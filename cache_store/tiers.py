"""The tiers a cache lives in, and the decisions that move it between them: room on the device (evicting in the
policy's order, offloading to the host tier), a host copy restored (after the shared segment it names, found or
restored first), what a fetch from Redis brought adopted, a shared segment found, a resident cache checked, a cache
dropped from every tier, a failed check reported.

The only holder of the device, host and remote tiers, the session notes and the counters. The moves themselves
(`TierMoves`, `RemoteMoves`) are plain transfers that return what they did; this records it (counters, losses, copy
timings). Below the cache store (`CacheStore`, the boundary that serves the turns and calls only this), above the
moves and the tiers. In the engine thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Sequence

import cache_store.device.chain as chain
from cache_store.checks.integrity import Check, check_identity, check_tensors, checksum
from cache_store.device.arena import UNIT
from cache_store.device.device_tier import DeviceTier
from cache_store.device.entry import CacheEntry, holding
from cache_store.device.segments import SharedSegments, is_segment, segment_key
from cache_store.failure_log import log_failure
from cache_store.host.host_tier import HostTier
from cache_store.host.offload import HostEntry
from cache_store.lookup import CopyObserver
from cache_store.remote.remote_caches import RemoteCaches
from cache_store.remote.remote_moves import FetchOutcome, RemoteMoves
from cache_store.session_notes import SessionNotes
from cache_store.tier_moves import Moved, TierMoves

log = logging.getLogger(__name__)


class CacheTiers:
    """Device, host and Redis, with the moves between them and what they record."""

    def __init__(self, device: DeviceTier, host: HostTier, segments: SharedSegments, moves: TierMoves,
                 notes: SessionNotes, remote: RemoteCaches | None, remote_moves: RemoteMoves | None,
                 on_copy: CopyObserver):
        self.device, self.host, self.segments, self.moves = device, host, segments, moves
        self.notes, self.remote, self.remote_moves, self.on_copy = notes, remote, remote_moves, on_copy
        self.counters: Counter[str] = Counter()

    def place(self, key: str, entry: CacheEntry) -> None:
        """Put `entry` on the device as `key`'s cache (evicted last while its client is connected)."""
        self.device.put(key, entry, connected=key in self.notes.connected)

    def owner_of(self, key: str) -> str | None:
        """Whose caches a tier's key belongs to: a segment's, or a session's as its last turn said."""
        return self.segments.owner_of(key) if is_segment(key) else self.notes.owner_of(key)

    def newest_copy(self, key: str) -> CacheEntry | HostEntry | None:
        """The session's copy on this worker: on the device, else in the host tier."""
        return self.device.peek(key) or self.host.get(key)

    def discard_copies(self, key: str) -> None:
        """A stale session's copies on the device and the host are of no use."""
        self.device.discard(key)
        self.host.discard(key)

    def cropped(self, key: str, tokens: int) -> None:
        """A session's resident cache was cut to `tokens` for a turn: a host copy holding positions past them is
        of no use (they are computed again), so that its next offload is whole."""
        self.device.cropped(key)
        if (kept := self.host.get(key)) is not None and len(kept.token_ids) > tokens:
            self.host.discard(key)

    def connected(self, key: str, connected: bool) -> None:
        """Whether a client is connected to the session: connected caches are evicted last."""
        (self.notes.connected.add if connected else self.notes.connected.discard)(key)
        if (residency := self.device.residency(key)) is not None:
            residency.connected = connected

    def expire(self, deadline: float) -> list[str]:
        """Drop the caches of disconnected sessions idle since before `deadline` (not those kept resident for a
        cache breakpoint, until its own ttl ends), on the device and the host."""
        def idle_since(key: str) -> float:
            residency = self.device.residency(key)
            return float("inf") if residency.running or residency.connected else residency.last_access

        expired = [key for key in self.device if not is_segment(key) and idle_since(key) < deadline
                   and not self.notes.kept(key)]
        named = {self.host.get(key).prefix_key for key in self.host.keys()}  # segments that host entries start with
        expired += [key for key in self.host.keys() if key not in self.notes.connected and key not in named
                    and self.host.put_at(key) < deadline and not self.notes.kept(key)]
        for key in expired:
            self.discard_copies(key)
            self.notes.lost(key)
            self.counters["expired"] += 1
        return expired

    # ##### Room on the device #####

    def admit(self, key: str, nbytes: int, alone: bool) -> bool:
        """Room for a turn whose cache may reach `nbytes`, reserved against the device budget: idle caches evicted in
        the policy's order; when even all of them would not do, False, unless the turn is `alone` (then every idle
        cache goes and it runs over the budget)."""
        victims, fits = self.device.plan_room(self.device.extra_bytes(key, nbytes), keep=key)
        if not fits and not alone:
            return False
        for victim in victims:
            self.evict(victim)
        if not fits:  # alone over the budget: every idle cache goes (segments once nothing starts with them)
            self.evict_idle(keep=key)
        self.device.reserve(key, nbytes)
        return True

    def make_room(self, need_bytes: int, keep: str | Sequence[str] = ()) -> None:
        """Evict, in the policy's order, what `need_bytes` more on the device need (never `keep`)."""
        for key in self.device.plan_room(need_bytes, keep=keep)[0]:
            if key in self.device:
                self.evict(key)

    def evict(self, key: str) -> None:
        """Take a cache off the device: to the host tier, or, for a shared segment already there (it never changes)
        or that nothing there names, dropped without a copy."""
        if is_segment(key) and (key in self.host or not self.moves.segment_needed(key)):
            self.device.discard(key)
            self.counters["prefix_evictions"] += 1
            return
        self.offload(key)

    def evict_one(self) -> bool:
        """Evict the idle cache the policy ranks lowest (to free a region of the arena); False if none is idle."""
        victims = sorted((self.device.residency(key) for key in self.device if self.device.is_evictable(key)),
                         key=self.device.policy.priority)
        if not victims:
            return False
        self.evict(victims[0].key)
        return True

    def evict_idle(self, keep: str | None = None) -> int:
        """Evict every cache that is not running (nor `keep`); shared segments go once nothing resident starts
        with them. Returns how many went."""
        moved = 0
        while victims := [key for key in self.device if key != keep and self.device.is_evictable(key)]:
            for key in victims:
                self.evict(key)
            moved += len(victims)
        return moved

    def offload(self, key: str) -> None:
        """Move a device cache to the host tier; one that does not fit there, or whose copy fails or finds it changed
        while resident, is lost (its next turn recomputes) and nothing else fails."""
        with holding(self.device.pop(key)) as entry:  # (the tier's reference, let go once copied)
            moved = self.moves.offload(key, entry, self.notes.scope_of(key), self.notes.prompt_tokens(key))
        self._record(moved, "offload")
        if moved.failed:
            self.report_corruption(key, moved.failed)
        elif moved.dropped:
            self.drop(key)

    def continued_copy(self, key: str, entry: CacheEntry) -> HostEntry | None:
        """The host copy the next offload of a session's `entry` continues (the stack it was restored from, or its
        owner's named copy of its system prompt), if it has one: only the positions after it are copied then."""
        if self.host.get(key) is None:
            return None
        return self.moves.offload_base(key, entry, self.host.get(key), self.notes.scope_of(key),
                                       self.notes.prompt_tokens(key))[1]

    # ##### Back onto the device #####

    def restore(self, key: str, for_turn: bool = False) -> tuple[CacheEntry | None, tuple[Check, ...]]:
        """Bring a host copy (a session's, or a shared segment's) back to the device once it passes every check,
        up to its last good copy (with the failure: the turn recomputes only the rest); None when not even its first
        copy passes, or the segment it names is gone (then it is dropped and its turn recomputes). `for_turn`:
        handed to a turn at once, which changes it, so no checksum is taken now. The device holds what it returns."""
        started = time.perf_counter()
        if is_segment(key):  # A segment never changes: its host copy stays, so letting it go again copies nothing.
            return self._restore_segment(key, started)
        whole = self.host.take(key)  # (ours while it is read: room made meanwhile never drops a copy of it)
        try:
            good, failed = self.moves.last_good(key, whole, self.notes.scope_of(key))
            if failed and good is not None:
                log.warning("session %s: a host copy of its cache failed the %s check; restoring the copies before "
                            "it", key, ", ".join(failed))
            entry = self._bring_back(key, good, started, stamp=not for_turn) if good is not None else None
            if entry is not None:
                self.host.put(key, good, first_to_go=True)  # the session's next offload continues it
        except BaseException:  # no room (ArenaFull), or a copy that failed: the host copy is as it was
            self.host.put(key, whole)
            raise
        finally:
            self.host.release(whole)  # (what the tier keeps of it stays)
        if entry is not None:
            self.counters["restores"] += 1
        return entry, failed

    def _restore_segment(self, key: str, started: float) -> tuple[CacheEntry | None, tuple[Check, ...]]:
        """A segment's host copy stays in the tier, but is held while it is read: the room made for it on the
        device offloads other caches, and the host may drop this very copy to take them (nothing there needs it once
        the session restored after it was taken out)."""
        copy = self.host.get(key)
        self.host.acquire(copy)
        try:
            good, failed = self.moves.last_good(key, copy, self.notes.scope_of(key))
            entry = self._bring_back(key, good, started) if good is not None else None
        finally:
            self.host.release(copy)
        if entry is None and failed:
            self.host.discard(key)
        elif entry is not None:
            entry.cache.frozen, entry.cache.segment_key = True, key
            if key in self.host:  # (else dropped meanwhile: its next offload copies it again)
                self.host.touch(key)
            self.counters["segment_restores"] += 1
        return entry, failed

    def _bring_back(self, key: str, good: HostEntry, started: float, stamp: bool = True) -> CacheEntry | None:
        """The checked copy `good` on the device, after the segment it names (found, or restored first); None when
        that segment is gone (the cache is lost). Its restore time counts the checks and the copy, not the
        evictions that made room for it."""
        segment = None
        if good.prefix_key is not None:
            segment = self.find_segment(good.prefix_key, good.token_ids[:good.prefix_tokens])
            if segment is None or segment.num_tokens != good.prefix_tokens:
                self.notes.lost(key)
                return None
        checked_s = time.perf_counter() - started
        if good.device_nbytes <= self.device.budget_bytes:  # else it is restored outside the arena
            # (the segments it will start with stay: nothing starts with them until it does)
            keep = [key, *(piece.segment_key for piece in [*chain.segments(segment.cache), segment.cache])] \
                if segment is not None else [key]
            self.make_room(self.device.extra_bytes(key, good.device_nbytes), keep=keep)
        copy_started = time.perf_counter()
        with holding(self.moves.copy_in(key, good, segment, stamp)) as entry:
            self.place(key, entry)
        self.on_copy("restore", "host", checked_s + time.perf_counter() - copy_started)
        return entry

    def adopt(self, key: str, outcome: FetchOutcome, held: CacheEntry | None) -> CacheEntry | None:
        """What a fetch from Redis brought, copied into place after what `held` keeps, on the device (None: it
        continues nothing held, and the turn recomputes). The device holds what it returns."""
        adoption = self.remote_moves.prepare(key, outcome, held)
        if adoption is None:
            return None
        self.make_room(self.device.extra_bytes(key, adoption.own_bytes), keep=adoption.keep)
        copy_started = time.perf_counter()
        entry = self.remote_moves.adopt(key, adoption)
        self.place(key, entry)
        if entry is not held:
            entry.release()  # (the tier holds it; the lookup hands the turn a reference of its own)
        self.on_copy("restore", "remote", outcome.fetched_s + time.perf_counter() - copy_started)
        self.counters["remote_restores"] += 1
        return entry

    def share_system_prompt(self, entry: CacheEntry, prompt_ids: Sequence[int], prefix_len: int, owner: str | None,
                            min_shared_tokens: int) -> None:
        """After a restore from Redis, make the whole units of the prompt's system prompt a shared segment here
        (nothing copied) when none holds it yet: the next session with that system prompt starts with it, and a
        later restore from Redis fetches none of its chunks."""
        tokens = prefix_len // UNIT * UNIT
        if (tokens < max(UNIT, min_shared_tokens) or entry.prefix_tokens or entry.num_tokens <= tokens
                or entry.token_ids[:prefix_len] != list(prompt_ids[:prefix_len])):
            return
        key = segment_key(prompt_ids[:prefix_len], owner)
        if self.segments.share(entry, key, tokens=tokens, owner=owner) is not None:
            self.counters["remote_policies_held"] += 1

    def share_remotely(self, key: str, entry: CacheEntry) -> None:
        """Snapshot a session's written-back cache for Redis (written on the remote tier's threads). A failure costs
        only the other workers, which keep the copy before."""
        try:
            self.counters.update(self.remote_moves.share(key, entry, self.notes.scope_of(key)))
        except Exception as error:  # the turn is done and its cache is here: only other workers go without it
            log_failure(log, error, "session %s: snapshotting its cache for Redis failed; Redis keeps the copy "
                                    "before", key)
            self.counters["remote_snapshot_failures"] += 1

    def find_segment(self, key: str, token_ids: list[int]) -> CacheEntry | None:
        """The segment `key` holding exactly `token_ids`: on the device (checked), or brought back from the host
        tier (checked); a segment that fails a check is dropped with what starts with it."""
        segment, failed = self.segments.find(key, token_ids)
        held = self.host.get(key)
        if segment is None and not failed and held is not None and held.token_ids == token_ids[:len(held.token_ids)]:
            segment, failed = self.restore(key)
        if failed:
            self.report_corruption(key, failed)
        return segment

    def check_resident(self, owner: str, entry: CacheEntry) -> tuple[Check, ...]:
        """Every check of a device-resident cache, its checksum included, and of every shared segment it starts
        with: a cache is only ever reused with the bytes it was written back with. A failed segment is dropped
        with every cache that starts with it."""
        key, failed_segment = self.segments.check_chain(entry)
        if key is not None:
            if key in self.device:  # (counted once, as the session's corruption, by the caller)
                log.warning("shared segment %s failed the %s check; dropped", key, ", ".join(failed_segment))
                self.drop(key)
            return failed_segment
        model_key, layout = self.segments.model_key, self.segments.layout
        failed = (check_identity(entry.fingerprint, model_key, owner, entry.token_ids, layout)
                  or check_tensors(entry.tensors(), entry.own_tokens, layout)
                  or (checksum(entry.tensors()) != entry.checksum and "checksum"))
        return (failed,) if failed else ()

    # ##### Gone #####

    def report_corruption(self, key: str, failed: tuple[Check, ...], remote_up_to: int | None = None) -> None:
        """A check failed: clear the session's cache (or the shared segment's, and every resident cache that
        starts with it) on this worker, and count it; with `remote_up_to`, its copy in Redis too (`drop`)."""
        log.warning("%s: cache failed the %s check; cleared, recomputing",
                    f"shared segment {key}" if is_segment(key) else f"session {key}", ", ".join(failed))
        self.drop(key, remote_up_to)
        self.count_corruption(failed)

    def count_corruption(self, failed: tuple[Check, ...]) -> None:
        for check in failed:
            self.counters[f"corrupt_{check}"] += 1

    def drop(self, key: str, remote_up_to: int | None = None) -> None:
        """Drop a session's cache from this worker's tiers; its next turn here recomputes (or fetches it from Redis).
        Dropping a shared segment drops every resident cache that starts with it (a cache that names it in a lower
        tier finds it again, or recomputes) and its host copy. With `remote_up_to`, the session's copy in Redis is
        deleted too if its version is at most that (the copy found bad or of no use: never one written since);
        without, it stays for the session's next turn, here or on another worker (it is checked on every fetch). A
        session's chunks in Redis stay for the sessions that share them (each is deleted when it fails a check)."""
        if is_segment(key):
            for dependent in self.segments.drop(key):
                self.notes.lost(dependent)
        self.device.discard(key)
        self.host.discard(key)
        if self.remote is not None and remote_up_to is not None and not is_segment(key):
            self.remote.delete(key, remote_up_to)

    def _record(self, moved: Moved, direction: str) -> None:
        self.counters.update(+moved.counters)
        for key in moved.lost:
            self.notes.lost(key)
        if moved.seconds is not None:
            self.on_copy(direction, "host", moved.seconds)
