"""The KV arena: per layer one buffer `[kv_heads, tokens, head_dim]`, allocated once on the compute
device; a session's cache is a region of it (the same positions in every layer) plus its length.

A cache may start with a chain of shared, read-only segments (`cache_store/device/chain.py`): its own region then
holds only the tokens after them, and its layers count positions from the chain's end (`offset`).

Regions are exactly as long as they ask for, in units of `UNIT` tokens (`RunAllocator`): a turn's region
is reserved at admission for its prompt and `max_new_tokens`, shrunk at write-back to the cache's length
(rounded up to a unit: the only slack), grown in place when the run after it is free and moved once
otherwise. When the free units would do but no run is long enough, the arena slides resident regions
together (device-to-device copies) before anyone is evicted. Keys and values are written in place at a
row's own position; a layer hands attention a view of its region, never a copy, and reads the region's
start when asked, so a region can move between two steps.

Ownership, as vLLM's block pool counts a block's holders: an `ArenaCache` counts its holders (`refs`): whoever made
it, the device tier for each key that keeps it, a running turn, and every cache that starts with it (a segment).
Each holder lets go with `release`; the last release is the one path by which a region is freed (and the segment a
cache starts with let go). Nothing waits for the garbage collector: a cache collected with its region still held is
a leak, counted in `stats` (`arena_leaked_regions`) and caught by `tests/test_ownership.py`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, CacheLayerMixin, DynamicCache

from cache_store.device.allocator import RunAllocator
from cache_store.units import UNIT


class ArenaFull(RuntimeError):
    """No free region is large enough, even after compaction and evicting every idle cache."""


def units_for(tokens: int) -> int:
    """The units of a region that holds `tokens` (at least one)."""
    return max(1, -(-tokens // UNIT))


class ReleasedCache(RuntimeError):
    """A cache used, acquired or released after its last holder let it go: an ownership bug, never papered over."""


class TemporaryCache(DynamicCache):
    """A cache outside the arena, for a conversation longer than the whole arena: it lives for one turn,
    outside the device budget (counted as a turn outside the arena), and leaves the device at write-back."""


class _Region:
    """A cache's positions in the arena, [start, start + capacity); the arena moves it in compaction."""

    def __init__(self, start: int, capacity: int, owner: ArenaCache):
        self.start, self.capacity = start, capacity
        self._owner = weakref.ref(owner)

    def used(self) -> int:
        """Tokens its cache holds (what a move copies)."""
        owner = self._owner()
        return owner.used_tokens() if owner is not None else 0

    def leaked(self) -> bool:
        """Whether its cache was collected without its last holder releasing it (the units stay taken)."""
        return self._owner() is None


class KVArena:
    """Per-layer key and value buffers allocated once; caches are regions of them."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 tokens: int, make_room: Callable[[int], bool] | None = None, windows: Sequence[int | None] = ()):
        units = tokens // UNIT
        self.tokens = units * UNIT
        self.keys = [torch.empty(kv_heads, self.tokens, head_dim, dtype=dtype, device=device) for _ in range(layers)]
        self.values = [torch.empty_like(keys) for keys in self.keys]
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        # Each layer's sliding window (None: full attention). Every layer keeps every token of a region;
        # a sliding layer's attention reads only its window of it.
        self.windows = tuple(windows) or (None,) * layers
        self.allocator = RunAllocator(units)
        self.make_room = make_room or (lambda tokens: False)  # evicts one idle cache; False when none is left
        self._regions: set[_Region] = set()
        self.compactions = 0
        self.compaction_bytes = 0  # bytes moved by compactions
        self.compaction_seconds = 0.0

    def nbytes(self) -> int:
        return self.tokens * self.bytes_per_token

    def region_tokens(self, tokens: int) -> int:
        """The tokens a region for `tokens` holds: rounded up to a whole unit."""
        return units_for(tokens) * UNIT

    def allocate(self, tokens: int, owner: ArenaCache) -> _Region:
        """A free region for `tokens`: compacting when the free units would do, else evicting idle caches
        one at a time. Compaction may move any region, the caller's own included."""
        units = units_for(tokens)
        if units > self.allocator.units:
            raise ArenaFull(f"a cache of {tokens} tokens is longer than the whole KV arena ({self.tokens} tokens)")
        while (start := self.allocator.allocate(units)) is None:
            if self.allocator.free_units() >= units and self.compact(units):
                continue
            if not self.make_room(tokens):
                raise ArenaFull(f"no room for a region of {units * UNIT} tokens in the KV arena")
        region = _Region(start * UNIT, units * UNIT, owner)
        self._regions.add(region)
        return region

    def grow(self, region: _Region, tokens: int) -> bool:
        """Extend `region` in place to hold `tokens`, if the run after it is free."""
        units, more = region.capacity // UNIT, units_for(tokens) - region.capacity // UNIT
        if not self.allocator.grow(region.start // UNIT, units, more):
            return False
        region.capacity += more * UNIT
        return True

    def shrink(self, region: _Region, tokens: int) -> None:
        """Give back what `region` holds beyond `tokens` (rounded up to a unit)."""
        keep = min(units_for(tokens), region.capacity // UNIT)
        self.allocator.shrink(region.start // UNIT, region.capacity // UNIT, keep)
        region.capacity = keep * UNIT

    def split(self, region: _Region, units: int, owner: ArenaCache) -> _Region:
        """Hand the first `units` of `region` to `owner` as a region of its own (a shared segment taken from the
        start of a cache); `region` keeps the rest, which may be none. Nothing moves."""
        head = _Region(region.start, units * UNIT, owner)
        region.start += units * UNIT
        region.capacity -= units * UNIT
        self._regions.add(head)
        return head

    def release(self, region: _Region) -> None:
        """Give a region's units back (its cache's last holder let go, or the cache moved to another region)."""
        if region in self._regions:
            self._regions.discard(region)
            self.allocator.release(region.start // UNIT, region.capacity // UNIT)

    def compact(self, units: int) -> bool:
        """Make a free run of `units` by sliding the cheapest stretch of neighbouring regions together: of every
        stretch whose free runs (before, between and after its regions) add up to `units`, the one whose caches
        hold the fewest tokens; only the tokens each region holds are copied. Whether such a run now exists."""
        started = time.perf_counter()
        regions = sorted(self._regions, key=lambda r: r.start)
        stretch = self._cheapest_stretch(regions, units * UNIT)
        moved = 0
        if stretch is not None:
            first, last = stretch
            position = regions[first - 1].start + regions[first - 1].capacity if first else 0
            for region in regions[first:last]:
                if region.start != position:
                    used = region.used()
                    self.copy(region.start, position, used)
                    moved += used
                    region.start = position
                position += region.capacity
            self.allocator.rebuild((r.start // UNIT, r.capacity // UNIT) for r in self._regions)
        self.compactions += 1
        self.compaction_bytes += moved * self.bytes_per_token
        self.compaction_seconds += time.perf_counter() - started
        return self.allocator.largest_free() >= units

    def _cheapest_stretch(self, regions: list[_Region], tokens: int) -> tuple[int, int] | None:
        """(first, last): sliding `regions[first:last]` towards `regions[first - 1]` joins the free runs around
        them into one of at least `tokens`, copying the fewest tokens; None when no stretch frees that much.
        Two pointers over the regions in order: the free tokens and the cost of a stretch both grow with it."""
        ends = [0] + [r.start + r.capacity for r in regions]  # ends[k]: where the free run before regions[k] starts
        starts = [r.start for r in regions] + [self.tokens]  # starts[k]: where that run ends
        gaps = [start - end for start, end in zip(starts, ends, strict=True)]
        used = [r.used() for r in regions]
        best, best_cost = None, None
        last, free, cost = 0, gaps[0], 0
        for first in range(len(regions) + 1):
            if last < first:
                last, free, cost = first, gaps[first], 0
            while free < tokens and last < len(regions):
                cost += used[last]
                last += 1
                free += gaps[last]
            if free < tokens:
                break
            if best_cost is None or cost < best_cost:
                best, best_cost = (first, last), cost
            if first < len(regions):  # the stretch loses its first gap and region
                free -= gaps[first]
                cost -= used[first] if last > first else 0
        return best

    def copy(self, source: int, target: int, tokens: int) -> None:
        """Copy `tokens` positions of every layer from `source` to `target` (the ranges may overlap)."""
        if tokens <= 0 or source == target:
            return
        for buffers in (self.keys, self.values):
            for buffer in buffers:
                chunk = buffer[:, source:source + tokens]
                if abs(source - target) < tokens:
                    chunk = chunk.clone()  # overlapping ranges: through a transient copy
                buffer[:, target:target + tokens] = chunk

    def stats(self) -> dict[str, int | float]:
        """Tokens in caches (used), held by regions beyond that (reserved), free; the longest free run;
        compactions."""
        held = sum(region.capacity for region in self._regions)
        used = sum(min(region.used(), region.capacity) for region in self._regions)
        return {"arena_used_tokens": used, "arena_reserved_tokens": held - used,
                "arena_leaked_regions": sum(region.leaked() for region in self._regions),
                "arena_free_tokens": self.allocator.free_units() * UNIT,
                "arena_largest_free_tokens": self.allocator.largest_free() * UNIT,
                "arena_compactions": self.compactions, "arena_compaction_bytes": self.compaction_bytes,
                "arena_compaction_seconds": self.compaction_seconds}


class ArenaLayer(CacheLayerMixin):
    """One layer of a session's cache: a view of its region, `length` tokens long."""

    is_sliding = False

    def __init__(self, cache: ArenaCache, index: int):
        self._cache = weakref.proxy(cache)  # a pointer back, not a holder: no cycle keeps the cache object alive
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
        """Its own tokens (after the chain it starts with, if any)."""
        region = self._cache.region
        if region is None and self.length:
            raise ReleasedCache("a released cache was read")
        start = region.start if region is not None else 0
        return buffer[:, start:start + self.length].unsqueeze(0)

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        return None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs
               ) -> tuple[torch.Tensor, torch.Tensor]:
        new = key_states.shape[-2]
        if self._cache.frozen:
            raise RuntimeError("a shared segment of the KV arena is read-only")
        self._cache.reserve(self._cache.offset + self.length + new)
        start = self._cache.region.start + self.length
        self._cache.arena.keys[self._index][:, start:start + new] = key_states[0]
        self._cache.arena.values[self._index][:, start:start + new] = value_states[0]
        self.length += new
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._cache.offset + self.length + query_length, 0

    def get_seq_length(self) -> int:
        """Positions it covers, the chain it starts with included."""
        return self._cache.offset + self.length

    def get_max_length(self) -> int:
        return -1

    def crop(self, tokens_to_remove: int) -> None:
        """Remove `-tokens_to_remove` of its own tokens (a negative count, as transformers' layers take it); a
        crop into the chain is `chain.crop`'s."""
        self.length = max(0, self.length + min(0, tokens_to_remove))


class ArenaCache(Cache):
    """A session's cache in the arena, usable wherever transformers takes a `Cache`."""

    def __init__(self, arena: KVArena):
        self.arena = arena
        self.region: _Region | None = None
        self.prefix: ArenaCache | None = None  # the shared segment it starts with (`cache_store/device/chain.py`)
        self.offset = 0  # the positions of that chain: its own region holds positions from here on
        self.frozen = False  # a shared segment: read-only, other caches start with it
        self.segment_key: str | None = None  # a segment's key in the device tier
        self.refs = 1  # its holders (see the module's docstring); whoever made it holds the first
        self.users = 0  # of them, the caches that start with it (a segment's)
        super().__init__(layers=[ArenaLayer(self, index) for index in range(len(arena.keys))])

    def acquire(self) -> ArenaCache:
        """One more holder."""
        if self.refs <= 0:
            raise ReleasedCache("a cache was acquired after its last holder released it")
        self.refs += 1
        return self

    def release(self, count: int = 1) -> None:
        """`count` holders let go. The last frees the region and lets go of the segment the cache starts with."""
        if count > self.refs:
            raise ReleasedCache(f"a cache with {self.refs} holders was released {count} times")
        self.refs -= count
        if self.refs == 0:
            self._give_back()
            self.start_with(None)
            for layer in self.layers:
                layer.length = 0

    def start_with(self, segment: ArenaCache | None) -> None:
        """Hold `segment` as the one this cache starts with, letting go of the one before (`chain.attach`)."""
        if segment is not None:
            segment.acquire()
            segment.users += 1
        if self.prefix is not None:
            self.prefix.users -= 1
            self.prefix.release()
        self.prefix = segment

    def reserve(self, tokens: int) -> None:
        """Make the region hold at least `tokens` positions (the chain included: the region holds those after
        it): in place when the run after it is free, else moved once."""
        if self.refs <= 0:
            raise ReleasedCache("a released cache was given room")
        tokens = max(1, tokens - self.offset)
        if self.region is not None and (tokens <= self.region.capacity or self.arena.grow(self.region, tokens)):
            return
        try:
            region = self.arena.allocate(tokens, self)
        except ArenaFull:
            if self.region is None:
                raise
            # No room beside the old region: set the cache aside, free its region, and allocate again.
            kept = [(layer.keys.clone(), layer.values.clone()) for layer in self.layers]
            self._give_back()
            try:
                self.load(kept, self.offset + tokens)
            except ArenaFull:
                self.load(kept)  # back into the units just freed, which hold it again
                raise
            return
        if self.region is not None:
            self.arena.copy(self.region.start, region.start, self.used_tokens())  # read after any compaction
            self._give_back()
        self.region = region

    def fit(self) -> None:
        """Shrink the region to what the cache holds (rounded up to a unit), as at write-back."""
        if self.region is not None:
            self.arena.shrink(self.region, max(1, self.used_tokens()))

    def used_tokens(self) -> int:
        """The most tokens any layer holds in its own region (they differ only mid-forward, or in a cache
        injected with a fault)."""
        return max((_own_length(layer) for layer in self.layers), default=0)

    def total_tokens(self) -> int:
        """The positions it covers: its chain's and its own."""
        return self.offset + self.used_tokens()

    def _give_back(self) -> None:
        """Return its region's units to the arena (the cache is released, or moves to another region)."""
        if self.region is not None:
            self.arena.release(self.region)
            self.region = None

    def load(self, tensors: Sequence[tuple[torch.Tensor, torch.Tensor]], room: int = 0) -> None:
        """Copy its own keys and values `[1, heads, tokens, head_dim]` per layer (those after its chain; never
        views of another arena cache: see `chain.start_from`) into a region of their own, with room for `room`
        positions (the chain included)."""
        self.load_parts([tensors], room)

    def load_parts(self, parts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], room: int = 0) -> None:
        """`load` for keys and values given as consecutive parts (a chain of host copies): each copied once,
        straight into its place in the region."""
        layers = min(len(self.layers), *(len(part) for part in parts))
        tokens = max((sum(part[index][0].shape[-2] for part in parts) for index in range(layers)), default=0)
        for layer in self.layers:
            layer.length = 0  # (what it held, if anything, is replaced)
        self.reserve(max(self.offset + tokens, room, self.offset + 1))
        self._write_after(parts, layers)

    def append_parts(self, parts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]]) -> None:
        """Copy keys and values given as consecutive parts after the positions it holds (the rest of a cache,
        fetched from a lower tier), growing its region."""
        added = sum(part[0][0].shape[-2] for part in parts)
        self.reserve(self.total_tokens() + added)
        self._write_after(parts, len(self.layers))

    def _write_after(self, parts: Sequence[Sequence[tuple[torch.Tensor, torch.Tensor]]], layers: int) -> None:
        """Copy each part once, straight into its place after each layer's positions (the region holds them)."""
        start = self.region.start
        for index, (layer, keys_buffer, values_buffer) in enumerate(
                zip(self.layers[:layers], self.arena.keys, self.arena.values, strict=False)):
            position = start + layer.length
            for part in parts:
                keys, values = part[index]
                length = keys.shape[-2]
                keys_buffer[:, position:position + length] = keys[0]
                values_buffer[:, position:position + length] = values[0]
                position += length
            layer.length = position - start

    def nbytes(self) -> int:
        """The bytes its own region holds in the arena (a shared segment's are counted once, as its own)."""
        return self.region.capacity * self.arena.bytes_per_token if self.region else 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.offset + _own_length(self.layers[layer_idx])


def _own_length(layer: CacheLayerMixin) -> int:
    """A layer's own tokens: an arena layer's length (a layer replaced by fault injection: its tensors')."""
    return layer.length if isinstance(layer, ArenaLayer) else layer.get_seq_length()
