"""Branches of a conversation: a regenerated reply, an edited message, a second tab. The branch's cache starts
with what it shares with the source's: the history both hold becomes a shared segment (nothing copied), and the
rest of what they share is copied once, device to device."""

from __future__ import annotations

from collections.abc import Sequence

import cache_store.device.chain as chain
from cache_store.checks.integrity import checksum, fingerprint
from cache_store.device.arena import UNIT, ArenaCache, ArenaFull
from cache_store.device.entry import CacheEntry, NewCache, holding
from cache_store.device.segments import segment_key
from cache_store.lookup import common_prefix_length
from cache_store.tiers import CacheTiers


def fork(tiers: CacheTiers, new_cache: NewCache, source: str, target: str, prompt_ids: Sequence[int]) -> int:
    """Start `target`'s cache from the part of `source`'s device-resident cache that `prompt_ids` begins
    with (a branch of a conversation: a regenerated reply, an edited message, a second tab): it starts
    with the same shared segments, and the rest of that part is copied. The source, running or not, is
    left as it is. Returns the positions it holds."""
    entry = tiers.device.get(source) if target not in tiers.device else None
    if entry is None or (entry.checksum is not None and tiers.check_resident(source, entry)):
        return 0  # (a running source is checked at its write-back)
    shared = min(common_prefix_length(entry.token_ids, prompt_ids), len(prompt_ids) - 1)
    if shared <= 0:
        return 0
    _share_history(tiers, source, entry, shared)
    try:
        copy = entry.clone(new_cache, shared)
    except ArenaFull:
        return 0  # no room for a copy now: the branch prefills from scratch
    copy.fingerprint = fingerprint(copy, tiers.segments.model_key, target, tiers.segments.layout)
    copy.checksum = checksum(copy.tensors())
    tiers.make_room(copy.nbytes(), keep=source)
    with holding(copy):
        tiers.place(target, copy)
    return shared


def _share_history(tiers: CacheTiers, source: str, entry: CacheEntry, shared: int) -> None:
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
    if key in tiers.device:
        return
    segment = CacheEntry(chain.split(entry.cache, tokens), token_ids)
    tiers.segments.keep(key, segment, owner=tiers.notes.owner_of(source))
    if entry.checksum is not None:
        entry.checksum = checksum(entry.tensors())
