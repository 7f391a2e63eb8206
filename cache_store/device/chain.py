"""The chain of a cache in the KV arena: the shared, read-only segments it starts with, then its own region.

A segment is an `ArenaCache` that is frozen: a system prompt that many sessions start with, or the history
that a branch of a conversation shares with its parent. A segment may itself start with another (a branch of
a conversation that started from a shared system prompt), so a chain has any depth; each cache points at the last
segment of its chain (`prefix`) and counts positions from that segment's end (`offset`). Its own region holds
only the positions after it.

A cache that starts with a segment is one of its holders (`ArenaCache.refs`, counted apart as `users`), from
`attach` until it starts with another or its own last holder releases it. A segment is never written and never
evicted while it has users; its region is freed when its last holder (the device tier, a user) releases it, as
for any cache. Moving a segment (compaction) moves it for every user at once, since users read its region's start
through the segment. vLLM keeps its block pool apart from the scheduler in the same way (`block_pool.py`):
these functions only move integers and views; which segment is shared, found, checked and evicted is the
cache store's business.
"""

from __future__ import annotations

import torch

from cache_store.device.arena import UNIT, ArenaCache, units_for

KVTensors = list[tuple[torch.Tensor, torch.Tensor]]


def segments(cache: ArenaCache) -> list[ArenaCache]:
    """The segments `cache` starts with, the first (the root) first."""
    chain = []
    segment = cache.prefix
    while segment is not None:
        chain.append(segment)
        segment = segment.prefix
    return chain[::-1]


def users(segment: ArenaCache) -> int:
    """How many live caches (sessions, turns, other segments) start with `segment`."""
    return segment.users


def attach(cache: ArenaCache, segment: ArenaCache | None) -> None:
    """Make `cache` start with `segment` (None: with nothing); its own tokens are untouched, so the caller
    attaches before it fills the region (or knows that the positions still line up)."""
    if not (segment is None or segment.frozen):
        raise ValueError("a cache can only start with a frozen (read-only) segment")
    cache.start_with(segment)
    cache.offset = segment.total_tokens() if segment is not None else 0


def split(cache: ArenaCache, tokens: int) -> ArenaCache:
    """Make the first `tokens` of `cache`'s own region a new frozen segment that `cache` then starts with;
    nothing is copied. `tokens` is all its own tokens (a system prompt just prefilled alone), or a whole number
    of units (so that the tokens after it keep their place at the start of the remaining region). The caller holds
    the new segment (and `cache`, one of its users, holds it too)."""
    own = cache.used_tokens()
    if cache.region is None or not 0 < tokens <= own or (tokens < own and tokens % UNIT):
        raise ValueError(f"cannot split {tokens} of {own} tokens off a cache")
    segment = ArenaCache(cache.arena)
    attach(segment, cache.prefix)
    units = min(units_for(tokens), cache.region.capacity // UNIT)
    segment.region = cache.arena.split(cache.region, units, segment)
    for mine, theirs in zip(cache.layers, segment.layers, strict=True):
        theirs.length = tokens
        mine.length -= tokens
    segment.frozen = True
    if cache.region.capacity == 0:
        cache._give_back()
    attach(cache, segment)
    return segment


def start_from(cache: ArenaCache, source: ArenaCache, tokens: int) -> int:
    """Make the empty `cache` hold the first `tokens` positions of `source`: it starts with the deepest segment
    of `source`'s chain (or `source` itself, if it is a segment) that ends within them, and only the positions
    after that segment are copied (device to device) into its own region. Returns the positions copied."""
    base, holder = _cut(source, tokens)
    attach(cache, base)
    copied = tokens - cache.offset
    cache.reserve(tokens)  # may compact, moving `holder`: its position is read after
    if copied:
        cache.arena.copy(holder.region.start, cache.region.start, copied)
    for layer in cache.layers:
        layer.length = copied
    return copied


def crop(cache: ArenaCache, keep: int) -> None:
    """Keep the first `keep` positions of `cache`. Within its own region this is a length change; a crop into
    the chain starts the cache from the deepest segment that ends within `keep` and copies the rest of the
    positions from the segment after it."""
    if keep >= cache.offset:
        for layer in cache.layers:
            layer.length = min(layer.length, keep - cache.offset)
        return
    base, holder = _cut(cache, keep)
    for layer in cache.layers:
        layer.length = 0
    attach(cache, base)
    copied = keep - cache.offset
    if copied:
        cache.reserve(keep)
        cache.arena.copy(holder.region.start, cache.region.start, copied)
        for layer in cache.layers:
            layer.length = copied


def full_tensors(cache: ArenaCache) -> KVTensors:
    """Every position's keys and values `[1, heads, tokens, head_dim]` per layer, the chain's and its own,
    as new tensors (a snapshot that stands alone: a Redis copy, a cache moved out of the arena)."""
    pieces = [*segments(cache), cache]
    return [(torch.cat([piece.layers[index].keys for piece in pieces], dim=2),
             torch.cat([piece.layers[index].values for piece in pieces], dim=2))
            for index in range(len(cache.layers))]


def tensors_from(cache: ArenaCache, start: int) -> KVTensors:
    """The keys and values of positions `start` on, the chain's and its own, as new tensors where they span
    pieces (views of one piece's region otherwise): what a snapshot of a cache's later positions copies."""
    pieces = [piece for piece in [*segments(cache), cache] if piece.total_tokens() > start] or [cache]
    layers = []
    for index in range(len(cache.layers)):
        parts = [(piece.layers[index].keys[..., max(0, start - piece.offset):, :],
                  piece.layers[index].values[..., max(0, start - piece.offset):, :]) for piece in pieces]
        layers.append(parts[0] if len(parts) == 1 else (torch.cat([k for k, _ in parts], dim=2),
                                                        torch.cat([v for _, v in parts], dim=2)))
    return layers


def _cut(source: ArenaCache, tokens: int) -> tuple[ArenaCache | None, ArenaCache]:
    """(base, holder): the deepest segment of `source`'s chain (`source` included when it is frozen) ending
    within `tokens` positions, and the piece after it, whose region starts with the positions after `base`."""
    pieces = [*segments(source), source]
    base, holder = None, pieces[0]
    for piece, after in zip(pieces, pieces[1:], strict=False):
        if piece.total_tokens() > tokens:
            break
        base, holder = piece, after
    if source.frozen and source.total_tokens() <= tokens:
        base = source
    return base, holder
