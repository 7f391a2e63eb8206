"""The Redis side of a lookup (`--remote-kv`): what a turn asks Redis for, the fetch on the remote tier's threads,
and what it brought copied into place on the device, where the cache store decides to take it. Decisions about room
are the tiers' (`CacheTiers.make_room`); the copies are `RemoteMoves`'."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

from cache_store.device.arena import UNIT
from cache_store.device.entry import CacheEntry
from cache_store.device.segments import segment_key
from cache_store.host.offload import HostEntry
from cache_store.remote.cost_model import CostModel
from cache_store.remote.remote_caches import RemoteCaches
from cache_store.remote.remote_moves import FetchOutcome, FetchRequest, HeldIds, RemoteFetch, RemoteMoves, fetch_copy
from cache_store.tiers import CacheTiers


class RemoteLookup:
    """Fetches from Redis for the turns of one cache store, and their adoption onto the device."""

    def __init__(self, remote: RemoteCaches, moves: RemoteMoves, tiers: CacheTiers, cost: CostModel,
                 min_shared_tokens: int, pin: bool):
        self.remote, self.moves, self.tiers, self.cost = remote, moves, tiers, cost
        self.min_shared_tokens, self.pin = min_shared_tokens, pin

    def request(self, session_id: str, session_version: int, own: CacheEntry | HostEntry | None,
                segment: CacheEntry | None) -> FetchRequest:
        """Ask for the session's copy in Redis, naming by their ids what a fetch may keep: the session's own older
        copy (`own`, on the device or the host), else the segment its prompt starts with."""
        if isinstance(own, HostEntry):
            held = HeldIds(tuple(own.token_ids), False, own.prefix_tokens)
        else:
            held = self.moves.held_ids(own if own is not None else segment)
        return FetchRequest(session_id, session_version, self.tiers.notes.scope_of(session_id), self.moves.model_key,
                            self.moves.layout, self.moves.remote_kv_dtype, held, pin=self.pin)

    def start(self, request: FetchRequest, prompt_tokens: int, done: Callable[[], None]) -> RemoteFetch:
        """Fetch on the remote tier's threads; the turn waits at most as long as recomputing would take."""
        job = self.remote.submit(lambda: fetch_copy(request, self.remote, self.cost))
        job.add_done_callback(lambda _: done())
        patience = self.cost.patience_s(prompt_tokens, self.remote.timeout_s)
        return RemoteFetch(job, time.monotonic(), patience, self.cost.prefill_s(prompt_tokens))

    def adopt(self, session_id: str, outcome: FetchOutcome, held: CacheEntry | None) -> CacheEntry | None:
        """What a fetch brought, copied into place after what `held` keeps, on the device (None: it continues
        nothing held, and the turn recomputes). The device holds what it returns."""
        adoption = self.moves.prepare(session_id, outcome, held)
        if adoption is None:
            return None
        tiers = self.tiers
        tiers.make_room(tiers.device.extra_bytes(session_id, adoption.own_bytes), keep=adoption.keep)
        copy_started = time.perf_counter()
        entry = self.moves.adopt(session_id, adoption)
        tiers.device.put(session_id, entry, connected=session_id in tiers.notes.connected)
        if entry is not held:
            entry.release()  # (the tier holds it; the lookup hands the turn a reference of its own)
        tiers.on_copy("restore", "remote", outcome.fetched_s + time.perf_counter() - copy_started)
        tiers.counters["remote_restores"] += 1
        return entry

    def share_system_prompt(self, entry: CacheEntry, prompt_ids: Sequence[int], prefix_len: int,
                            scope: str | None) -> None:
        """After a restore from Redis, make the whole units of the prompt's system prompt a shared segment here
        (nothing copied) when none holds it yet: the next session with that system prompt starts with it, and a
        later restore from Redis fetches none of its chunks."""
        tokens = prefix_len // UNIT * UNIT
        if (tokens < max(UNIT, self.min_shared_tokens) or entry.prefix_tokens or entry.num_tokens <= tokens
                or entry.token_ids[:prefix_len] != list(prompt_ids[:prefix_len])):
            return
        key = segment_key(prompt_ids[:prefix_len], scope)
        if self.tiers.segments.share(entry, key, tokens=tokens, owner=scope) is not None:
            self.tiers.counters["remote_policies_held"] += 1
