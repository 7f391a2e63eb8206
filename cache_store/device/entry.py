"""One session's KV cache together with the exact token ids it covers."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

import cache_store.device.chain as chain
from cache_store.device.arena import ArenaCache, TemporaryCache
from cache_store.identity import Fingerprint

KVTensors = list[tuple[torch.Tensor, torch.Tensor]]
# Makes an empty cache for a number of tokens: a region of the arena, or tensors of its own when the arena
# could never hold that many.
NewCache = Callable[[int], DynamicCache | ArenaCache]


@dataclass
class CacheEntry:
    """A `DynamicCache` and its token ids. The ids, not the transcript, say what the cache holds:
    whoever appends to the cache appends the same ids here (see `extend`)."""

    cache: DynamicCache | ArenaCache
    token_ids: list[int] = field(default_factory=list)
    fingerprint: Fingerprint | None = None  # taken at write-back, checked on reuse
    checksum: str | None = None  # of the bytes at write-back, checked on reuse (a running cache has none)
    session_version: int = 0  # the session's completed turns when this cache was written back
    # (start, checksum of its positions from start, `checksum` it was taken with): what an offload that continues
    # the host copy ending at start checks, rather than every byte; stale once `checksum` changes
    suffix_checksum: tuple[int, str, str] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def prefix_tokens(self) -> int:
        """Positions held by the shared segments its cache starts with (`cache_store/device/chain.py`), not by it."""
        return self.cache.offset if isinstance(self.cache, ArenaCache) else 0

    @property
    def own_tokens(self) -> int:
        """Positions its own keys and values hold: those after its shared segments."""
        return self.num_tokens - self.prefix_tokens

    @property
    def quantized(self) -> str | None:
        """"int8" when its keys and values came from a quantised copy (so they are not exact)."""
        return self.fingerprint.quantized if self.fingerprint is not None else None

    def acquire(self) -> CacheEntry:
        """One more holder of its cache (a region of the arena; other caches need no count)."""
        if isinstance(self.cache, ArenaCache):
            self.cache.acquire()
        return self

    def release(self) -> None:
        """One holder lets its cache go; the last frees its region (`ArenaCache.release`)."""
        if isinstance(self.cache, ArenaCache):
            self.cache.release()

    @property
    def released(self) -> bool:
        """Whether every holder let its cache go (its region is free: it holds nothing any more)."""
        return isinstance(self.cache, ArenaCache) and self.cache.refs == 0

    def seq_lengths(self) -> list[int]:
        """The sequence length of every layer; all equal `num_tokens` in a consistent entry."""
        return [layer.get_seq_length() for layer in self.cache.layers]

    def is_consistent(self) -> bool:
        return all(length == self.num_tokens for length in self.seq_lengths())

    def extend(self, token_ids: list[int]) -> None:
        """Record ids whose keys and values the model just appended to the cache."""
        self.token_ids += token_ids

    def crop(self, keep: int) -> None:
        """Keep the first `keep` tokens of every layer; used when a render diverged, a turn is
        rolled back, or a forward pass failed halfway through the layers. A crop into the shared segments
        its cache starts with copies what it keeps of them (`chain.crop`)."""
        if isinstance(self.cache, ArenaCache):
            chain.crop(self.cache, keep)
            del self.token_ids[keep:]
            return
        for layer in self.cache.layers:
            if layer.is_initialized and layer.get_seq_length() > keep:
                layer.crop(keep - layer.get_seq_length())
        del self.token_ids[keep:]

    def tensors(self) -> KVTensors:
        """Its own keys and values (after its shared segments), per layer: what its checksum covers."""
        return [(layer.keys, layer.values) for layer in self.cache.layers if layer.is_initialized]

    def nbytes(self) -> int:
        """Bytes the cache counts for in the device budget: its region of the KV arena, or the allocated
        storage of its own tensors (which after a crop is larger than the used length); none for a
        `TemporaryCache`, which is outside the arena and its budget by design."""
        if isinstance(self.cache, ArenaCache):
            return self.cache.nbytes()
        if isinstance(self.cache, TemporaryCache):
            return 0
        return sum(k.untyped_storage().nbytes() + v.untyped_storage().nbytes() for k, v in self.tensors())

    def clone(self, new_cache: NewCache, tokens: int | None = None) -> CacheEntry:
        """A copy in a cache of its own: whole (with its fingerprint and checksum), or its first `tokens`
        (without them: whoever keeps such a copy stamps it). In the arena it starts with the same shared segments
        and copies only the positions after them, once, device to device (`chain.start_from`)."""
        whole = tokens is None or tokens == self.num_tokens
        tokens = self.num_tokens if tokens is None else tokens
        cache = new_cache(tokens)
        if isinstance(cache, ArenaCache) and isinstance(self.cache, ArenaCache):
            with _released_on_failure(cache):
                chain.start_from(cache, self.cache, tokens)
            clone = CacheEntry(cache, self.token_ids[:tokens], self.fingerprint if whole else None)
        else:
            tensors = chain.full_tensors(self.cache) if isinstance(self.cache, ArenaCache) else self.tensors()
            clone = _fill(cache, [(k[..., :tokens, :], v[..., :tokens, :]) for k, v in tensors],
                          self.token_ids[:tokens], self.fingerprint if whole else None, owned=False)
        clone.checksum = self.checksum if whole and clone.prefix_tokens == self.prefix_tokens else None
        clone.session_version = self.session_version
        return clone

    def move_out_of_arena(self) -> None:
        """Hold its keys and values in a `TemporaryCache` rather than a region of the arena (a conversation
        about to outgrow the whole arena); the region is freed (its holders hold this entry, which then needs no
        count)."""
        if isinstance(self.cache, ArenaCache):
            arena_cache = self.cache
            self.cache = _fill(TemporaryCache(), chain.full_tensors(arena_cache), self.token_ids, self.fingerprint,
                               owned=True).cache
            arena_cache.release(arena_cache.refs)


@contextmanager
def holding(entry: CacheEntry) -> Iterator[CacheEntry]:
    """Hold `entry` for a scope: the caller's reference (from making it, or `acquire`) is released at its end."""
    try:
        yield entry
    finally:
        entry.release()


@contextmanager
def _released_on_failure(cache: ArenaCache) -> Iterator[None]:
    """A cache being filled is let go if filling it fails (no room): nothing else holds it yet."""
    try:
        yield
    except BaseException:
        cache.release()
        raise


def entry_from_parts(new_cache: NewCache, parts: list[KVTensors], token_ids: list[int],
                     fingerprint: Fingerprint | None = None, owned: bool = True,
                     prefix: ArenaCache | None = None) -> CacheEntry:
    """Existing key/value tensors (never views of an arena cache: see `CacheEntry.clone`), given as consecutive
    parts (a chain of host copies; often one), as a cache: each part copied once into its place in a region of
    the arena, or taken by a `DynamicCache` (joined, or as they are: copied first unless they are `owned`).
    With a `prefix` (a segment holding the positions before them) the cache starts with it; outside the arena
    the segment's keys and values are copied in front."""
    cache = new_cache(len(token_ids))
    if isinstance(cache, ArenaCache):
        with _released_on_failure(cache):
            if prefix is not None:
                chain.attach(cache, prefix)
            cache.load_parts(parts)
        return CacheEntry(cache, list(token_ids), fingerprint)
    if prefix is not None:
        parts = [chain.full_tensors(prefix), *parts]
    if len(parts) > 1:
        joined = [(torch.cat([part[layer][0] for part in parts], dim=2),
                   torch.cat([part[layer][1] for part in parts], dim=2)) for layer in range(len(parts[0]))]
        parts, owned = [joined], True
    return _fill(cache, parts[0], token_ids, fingerprint, owned)


def _fill(cache: DynamicCache | ArenaCache, tensors: KVTensors, token_ids: list[int],
          fingerprint: Fingerprint | None, owned: bool) -> CacheEntry:
    if isinstance(cache, ArenaCache):
        with _released_on_failure(cache):
            cache.load(tensors)
        return CacheEntry(cache, list(token_ids), fingerprint)
    if not owned:
        tensors = [(keys.clone(), values.clone()) for keys, values in tensors]
    while len(cache.layers) < len(tensors):
        cache.layers.append(DynamicLayer())
    for layer, (keys, values) in zip(cache.layers, tensors, strict=False):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return CacheEntry(cache, list(token_ids), fingerprint)
