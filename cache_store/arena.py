"""The KV arena: per layer one buffer `[kv_heads, tokens, head_dim]`, allocated once on the compute
device; a session's cache is a region of it (the same positions in every layer) plus its length.

Regions come from a buddy allocator in units of `UNIT` tokens, so a region is a power of two of units,
at least as long as what the turn may reach (reserved at admission). Keys and values are written in
place at a row's own position; what a layer hands attention is a view of the region, never a copy.
A region is freed when its cache object is garbage collected, wherever the cache was dropped.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

UNIT = 16  # tokens: the smallest region


class ArenaFull(RuntimeError):
    """No free region is large enough, even after evicting every idle cache."""


class BuddyAllocator:
    """Regions of 2**k units out of `units`, split and merged with their buddies."""

    def __init__(self, units: int):
        self.units = units
        self._free: dict[int, set[int]] = {}  # order -> offsets of free blocks of 2**order units
        offset = 0
        for order in range(units.bit_length() - 1, -1, -1):  # largest first: every block aligned to its size
            if units & (1 << order):
                self._free.setdefault(order, set()).add(offset)
                offset += 1 << order
        self.max_order = units.bit_length() - 1 if units else -1

    def allocate(self, order: int) -> int | None:
        """The offset of a free block of 2**order units, or None."""
        for found in range(order, self.max_order + 1):
            if self._free.get(found):
                offset = self._free[found].pop()
                while found > order:  # split, keeping the upper halves free
                    found -= 1
                    self._free.setdefault(found, set()).add(offset + (1 << found))
                return offset
        return None

    def release(self, offset: int, order: int) -> None:
        while order < self.max_order and (buddy := offset ^ (1 << order)) in self._free.get(order, ()):
            self._free[order].discard(buddy)
            offset, order = min(offset, buddy), order + 1
        self._free.setdefault(order, set()).add(offset)

    def largest_free(self) -> int:
        """Units of the largest free block."""
        return max((1 << order for order, offsets in self._free.items() if offsets), default=0)


def order_for(tokens: int) -> int:
    """The order of the smallest region that holds `tokens`."""
    units = max(1, -(-tokens // UNIT))
    return (units - 1).bit_length()


class KVArena:
    """Per-layer key and value buffers allocated once; caches are regions of them."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 tokens: int, make_room: Callable[[int], bool] | None = None, windows: Sequence[int | None] = ()):
        units = tokens // UNIT
        # Each layer's sliding window (None: full attention). Every layer keeps every token of a region;
        # a sliding layer's attention reads only its window of it.
        self.windows = tuple(windows) or (None,) * layers
        self.tokens = units * UNIT
        self.keys = [torch.empty(kv_heads, self.tokens, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty_like(keys) for keys in self.keys]
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        self.allocator = BuddyAllocator(units)
        self.make_room = make_room or (lambda tokens: False)  # evicts one idle cache; False when none is left

    @property
    def max_tokens(self) -> int:
        """The longest cache the arena can hold at all."""
        return (1 << self.allocator.max_order) * UNIT if self.allocator.max_order >= 0 else 0

    def region_tokens(self, tokens: int) -> int:
        return (1 << order_for(tokens)) * UNIT

    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def allocate(self, tokens: int) -> tuple[int, int]:
        """(start, capacity) of a free region for `tokens`, evicting idle caches while none is free."""
        order = order_for(tokens)
        if (1 << order) * UNIT > self.max_tokens:
            raise ArenaFull(f"a cache of {tokens} tokens is longer than the arena's largest region "
                            f"({self.max_tokens} tokens)")
        collected = False
        while (offset := self.allocator.allocate(order)) is None:
            if self.make_room(tokens):
                continue
            if collected:
                raise ArenaFull(f"no free region of {self.region_tokens(tokens)} tokens in the KV arena")
            gc.collect()  # a dropped cache caught in a reference cycle holds its region until collected
            collected = True
        return offset * UNIT, (1 << order) * UNIT

    def release(self, start: int, capacity: int) -> None:
        self.allocator.release(start // UNIT, order_for(capacity))


class _Region:
    """A cache's positions in the arena; freed when the cache that owns it is collected."""

    def __init__(self, arena: KVArena, start: int, capacity: int):
        self.arena, self.start, self.capacity = arena, start, capacity


class ArenaLayer(CacheLayerMixin):
    """One layer of a session's cache: a view of its region, `length` tokens long."""

    is_sliding = False

    def __init__(self, cache: ArenaCache, index: int):
        self._cache = weakref.proxy(cache)  # not a cycle: the cache (and its region) goes as soon as it is dropped
        self._index = index
        self.length = 0

    @property
    def is_initialized(self) -> bool:
        return self._cache.region is not None

    @property
    def keys(self) -> torch.Tensor:
        return self._view(self._cache.arena.keys[self._index])

    @property
    def values(self) -> torch.Tensor:
        return self._view(self._cache.arena.values[self._index])

    def _view(self, buffer: torch.Tensor) -> torch.Tensor:
        start = self._cache.region.start if self._cache.region else 0
        return buffer[:, start:start + self.length].unsqueeze(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        self._cache.reserve(self.length + new)
        start = self._cache.region.start + self.length
        self._cache.arena.keys[self._index][:, start:start + new] = key_states[0]
        self._cache.arena.values[self._index][:, start:start + new] = value_states[0]
        self.length += new
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` tokens (a negative count, as transformers' layers take it)."""
        self.length = max(0, self.length + min(0, tokens_to_remove))


class ArenaCache(Cache):
    """A session's cache in the arena, usable wherever transformers takes a `Cache`."""

    def __init__(self, arena: KVArena):
        self.arena = arena
        self.region: _Region | None = None
        super().__init__(layers=[ArenaLayer(self, index) for index in range(len(arena.keys))])

    def reserve(self, tokens: int) -> None:
        """Make the region hold at least `tokens` (moving the cache once if it must grow)."""
        if self.region is not None and tokens <= self.region.capacity:
            return
        try:
            start, capacity = self.arena.allocate(tokens)
        except ArenaFull:
            if self.region is None:
                raise
            # No room beside the old region: set the cache aside, free its region, and allocate again.
            kept = [(layer.keys.clone(), layer.values.clone()) for layer in self.layers]
            self._free()
            try:
                self.load(kept, tokens)
            except ArenaFull:
                self.load(kept)  # back into the block just freed, which holds it again
                raise
            return
        if self.region is not None:
            old = self.region.start
            for layer, keys, values in zip(self.layers, self.arena.keys, self.arena.values, strict=True):
                keys[:, start:start + layer.length] = keys[:, old:old + layer.length]
                values[:, start:start + layer.length] = values[:, old:old + layer.length]
            self._free()
        self._own(start, capacity)

    def _own(self, start: int, capacity: int) -> None:
        self.region = _Region(self.arena, start, capacity)
        self._finalizer = weakref.finalize(self, self.arena.release, start, capacity)

    def _free(self) -> None:
        self._finalizer()
        self.region = None

    def load(self, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]], room: int = 0) -> None:
        """Copy keys and values `[1, heads, tokens, head_dim]` per layer into a region of their own,
        with room for `room` tokens."""
        tokens = max((keys.shape[-2] for keys, _ in tensors), default=0)
        self.reserve(max(tokens, room, 1))
        start = self.region.start
        for layer, keys_buffer, values_buffer, (keys, values) in zip(
                self.layers, self.arena.keys, self.arena.values, tensors, strict=False):
            length = keys.shape[-2]
            keys_buffer[:, start:start + length] = keys[0]
            values_buffer[:, start:start + length] = values[0]
            layer.length = length

    def nbytes(self) -> int:
        """The bytes its region holds in the arena."""
        return self.region.capacity * self.arena.bytes_per_token if self.region else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.layers[layer_idx].length
