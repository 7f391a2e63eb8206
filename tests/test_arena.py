"""The KV arena's allocator and regions: exact sizes, coalescing, growth in place and by move, compaction
that keeps every cache's bytes, and no region ever overlapping another, over randomized sequences."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from cache_store.checks.integrity import checksum
from cache_store.device import chain
from cache_store.device.allocator import RunAllocator
from cache_store.device.arena import UNIT, ArenaCache, ArenaFull, KVArena, ReleasedCache
from sessions import Session
from tests.support import kv_budget_mb, run_together, running_engine

LAYERS, HEADS, HEAD_DIM = 2, 2, 4
SYSTEM = "You are the support agent of Northwind Internet. Be brief and polite."


def check_allocator(allocator: RunAllocator, regions: dict[int, int]) -> None:
    """Regions and free runs tile the arena exactly once, and no two free runs touch (they would have merged)."""
    spans = sorted([*regions.items(), *allocator.free_runs()])
    position = 0
    for start, units in spans:
        assert start == position and units > 0, (spans, position)
        position += units
    assert position == allocator.units
    runs = allocator.free_runs()
    assert all(a + n < b for (a, n), (b, _) in zip(runs, runs[1:], strict=False)), runs
    assert allocator.free_units() == sum(n for _, n in runs)
    assert allocator.largest_free() == max((n for _, n in runs), default=0)


def test_regions_are_exactly_as_long_as_asked_and_freed_runs_merge():
    allocator = RunAllocator(20)
    assert [allocator.allocate(n) for n in (3, 5, 2)] == [0, 3, 8]
    assert allocator.free_runs() == [(10, 10)]
    allocator.release(3, 5)
    assert allocator.free_runs() == [(3, 5), (10, 10)]
    allocator.release(8, 2)  # merges with both neighbours
    assert allocator.free_runs() == [(3, 17)]
    assert allocator.allocate(18) is None and allocator.allocate(17) == 3


def test_best_fit_takes_the_shortest_run_that_is_long_enough():
    allocator = RunAllocator(30)
    starts = [allocator.allocate(n) for n in (4, 1, 2, 1, 6, 1)]
    for start, units in ((starts[0], 4), (starts[2], 2), (starts[4], 6)):
        allocator.release(start, units)
    assert allocator.allocate(2) == starts[2] and allocator.allocate(3) == starts[0]
    first = RunAllocator(30, fit="first")
    starts = [first.allocate(n) for n in (4, 1, 2, 1)]
    first.release(starts[0], 4)
    first.release(starts[2], 2)
    assert first.allocate(2) == starts[0]


def test_a_region_grows_in_place_only_into_a_free_run_after_it_and_shrinks_by_its_tail():
    allocator = RunAllocator(16)
    a, b = allocator.allocate(4), allocator.allocate(4)
    assert not allocator.grow(a, 4, 1)  # b is right after a
    assert allocator.grow(b, 4, 8) and allocator.free_units() == 0
    allocator.shrink(b, 12, 2)
    assert allocator.free_runs() == [(6, 10)]
    allocator.release(a, 4)
    assert allocator.free_runs() == [(0, 4), (6, 10)]


@pytest.mark.parametrize("fit", ["best", "first"])
def test_thousands_of_random_operations_never_overlap_two_regions(fit):
    rng = random.Random(7)
    allocator = RunAllocator(256, fit=fit)
    regions: dict[int, int] = {}
    for _ in range(5000):
        operation = rng.random()
        if operation < 0.4 or not regions:
            units = rng.randint(1, 40)
            if (start := allocator.allocate(units)) is not None:
                assert start not in regions
                regions[start] = units
            else:
                assert allocator.largest_free() < units
        else:
            start = rng.choice(list(regions))
            units = regions[start]
            if operation < 0.6:
                more = rng.randint(1, 10)
                if allocator.grow(start, units, more):
                    regions[start] = units + more
            elif operation < 0.75:
                keep = rng.randint(1, units)
                allocator.shrink(start, units, keep)
                regions[start] = keep
            elif operation < 0.97:
                allocator.release(start, units)
                del regions[start]
            else:  # what compaction does: regions move, the allocator learns where they are
                position, moved = 0, {}
                for old in sorted(regions):
                    moved[position] = regions[old]
                    position += regions[old]
                regions = moved
                allocator.rebuild(regions.items())
        check_allocator(allocator, regions)


def arena(tokens: int, asked: list[int] | None = None) -> KVArena:
    """An arena whose requests for room (evictions) are counted in `asked`, and never granted."""
    return KVArena(LAYERS, HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), tokens=tokens,
                   make_room=lambda tokens: bool(asked is not None and asked.append(tokens)))


def filled(kv_arena: KVArena, tokens: int, room: int = 0) -> ArenaCache:
    cache = ArenaCache(kv_arena)
    cache.load([(torch.randn(1, HEADS, tokens, HEAD_DIM), torch.randn(1, HEADS, tokens, HEAD_DIM))
                for _ in range(LAYERS)], room)
    return cache


def tensors(cache: ArenaCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]


def test_a_region_is_what_the_cache_holds_rounded_to_a_unit_and_shrinks_at_write_back():
    kv_arena = arena(256)
    cache = filled(kv_arena, 20, room=60)
    assert cache.region.capacity == 64 and cache.nbytes() == 64 * kv_arena.bytes_per_token
    cache.fit()
    assert cache.region.capacity == 32 and kv_arena.allocator.free_units() * UNIT == 256 - 32
    stats = kv_arena.stats()
    assert (stats["arena_used_tokens"], stats["arena_reserved_tokens"], stats["arena_free_tokens"]) == (20, 12, 224)
    cache.release()
    assert kv_arena.allocator.free_units() * UNIT == 256 and kv_arena.stats()["arena_used_tokens"] == 0
    with pytest.raises(ReleasedCache):
        cache.reserve(16)  # a released cache is never written again


def test_a_region_is_freed_by_its_last_holder_and_a_dropped_cache_is_a_counted_leak():
    kv_arena = arena(256)
    cache = filled(kv_arena, 20)
    cache.acquire()
    cache.release()
    assert kv_arena.allocator.free_units() * UNIT == 256 - 32, "a holder is left: the region stays"
    cache.release()
    assert kv_arena.allocator.free_units() * UNIT == 256
    with pytest.raises(ReleasedCache):
        cache.release()
    forgotten = filled(kv_arena, 20)
    del forgotten
    gc.collect()
    assert kv_arena.stats()["arena_leaked_regions"] == 1, "nothing frees a region but its last release"
    assert kv_arena.allocator.free_units() * UNIT == 256 - 32


def test_growth_is_in_place_when_the_next_run_is_free_and_one_move_otherwise():
    kv_arena = arena(256)
    first = filled(kv_arena, 30)
    before = [t.clone() for pair in tensors(first) for t in pair]
    start = first.region.start
    first.reserve(90)  # the rest of the arena is free: in place
    assert first.region.start == start and first.region.capacity == 96
    first.fit()
    blocker = filled(kv_arena, 10)  # right after it
    first.reserve(60)
    assert first.region.start != start and first.region.capacity == 64
    assert all(torch.equal(a, b) for a, b in zip(before, [t for pair in tensors(first) for t in pair], strict=True))
    assert blocker.get_seq_length() == 10 and kv_arena.compactions == 0


def test_compaction_slides_caches_together_before_anyone_is_evicted_and_keeps_their_bytes():
    asked: list[int] = []
    kv_arena = arena(16 * UNIT, asked)
    caches = [filled(kv_arena, 2 * UNIT - 3) for _ in range(8)]  # 8 regions of 2 units: full
    for index in (1, 3, 5, 6):
        caches[index].release()  # four holes of 2 units, the longest run 4 units
        caches[index] = None
    kept = [c for c in caches if c is not None]
    digests = [checksum(tensors(c)) for c in kept]
    first_start, last_start = kept[0].region.start, kept[-1].region.start
    big = filled(kv_arena, 7 * UNIT)  # 7 units: more than any run, less than the 8 free
    assert kv_arena.compactions == 1 and asked == [], "compacted, and nobody was asked to leave"
    assert [checksum(tensors(c)) for c in kept] == digests
    # only the cheapest stretch moves: the two regions among the holes; the first and the last stay put
    assert kv_arena.compaction_bytes == sum(c.get_seq_length() for c in kept[1:3]) * kv_arena.bytes_per_token
    assert (kept[0].region.start, kept[-1].region.start) == (first_start, last_start)
    assert big.get_seq_length() == 7 * UNIT and kv_arena.allocator.free_units() == 1
    with pytest.raises(ArenaFull):
        filled(kv_arena, 2 * UNIT)  # 2 units > 1 free: only an eviction could help, and none is granted
    assert asked and set(asked) == {2 * UNIT}


def test_a_copy_of_a_cache_survives_the_compaction_its_own_region_triggers():
    kv_arena = arena(8 * UNIT)
    first, second = filled(kv_arena, UNIT), filled(kv_arena, UNIT)
    source = filled(kv_arena, 2 * UNIT)  # units 2-3
    rest = [filled(kv_arena, UNIT) for _ in range(4)]  # units 4-7
    expected = [t.clone() for pair in tensors(source) for t in pair]
    first.release()  # one free unit before the source, one after: no run of 2
    rest[0].release()
    copy = ArenaCache(kv_arena)
    chain.start_from(copy, source, 2 * UNIT)  # compaction slides `second` and the source down (overlapping the source)
    assert kv_arena.compactions == 1 and source.region.start == UNIT and copy.region.start == 3 * UNIT
    for cache in (source, copy):
        for got, want in zip([t for pair in tensors(cache) for t in pair], expected, strict=True):
            assert torch.equal(got, want)
    assert second.get_seq_length() == UNIT and first.refs == 0


class Resident:
    """Caches held by their sessions, evicted (dropped: their regions freed) newest first when the arena asks."""

    def __init__(self, tokens: int):
        self.arena = KVArena(LAYERS, HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), tokens=tokens,
                             make_room=self.evict)
        self.live: dict[int, tuple[ArenaCache, list[torch.Tensor]]] = {}
        self.busy: int | None = None  # the cache being worked on is never evicted
        self.evictions = 0

    def evict(self, _tokens: int) -> bool:
        victims = [key for key in self.live if key != self.busy]
        if not victims:
            return False
        self.live.pop(victims[-1])[0].release()
        self.evictions += 1
        return True

    def step(self, rng: random.Random, key: int) -> None:
        operation = rng.random()
        if operation < 0.35 or not self.live:
            tokens = rng.randint(1, 12 * UNIT)
            try:
                cache = filled(self.arena, tokens, room=tokens + rng.randint(0, 3 * UNIT))
            except ArenaFull:
                return
            self.live[key] = (cache, [t.clone() for pair in tensors(cache) for t in pair])
            return
        self.busy = rng.choice(list(self.live))
        cache, expected = self.live[self.busy]
        if operation < 0.5:
            cache.fit()
        elif operation < 0.65:
            try:
                cache.reserve(cache.get_seq_length() + rng.randint(1, 6 * UNIT))
            except ArenaFull:
                pass
        elif operation < 0.75:
            tokens = rng.randint(1, cache.get_seq_length())
            copy = ArenaCache(self.arena)
            try:
                chain.start_from(copy, cache, tokens)
            except ArenaFull:
                copy.release()
                return
            self.live[-key] = (copy, [t[..., :tokens, :].clone() for t in expected])
        else:
            self.live.pop(self.busy)[0].release()
        self.busy = None

    def check(self) -> None:
        regions = sorted((c.region.start, c.region.capacity) for c, _ in self.live.values())
        assert all(a + n <= b for (a, n), (b, _) in zip(regions, regions[1:], strict=False)), regions
        assert sum(n for _, n in regions) + self.arena.allocator.free_units() * UNIT == self.arena.tokens
        for cache, expected in self.live.values():
            for got, want in zip([t for pair in tensors(cache) for t in pair], expected, strict=True):
                assert torch.equal(got, want)


def test_randomized_caches_keep_their_bytes_and_never_overlap():
    rng = random.Random(3)
    torch.manual_seed(3)
    resident = Resident(64 * UNIT)
    for step in range(1, 1500):
        resident.step(rng, step)
        resident.check()
    assert resident.arena.compactions > 0 and resident.evictions > 0, "the sequence exercised both"


def test_many_sessions_of_mixed_lengths_under_a_small_budget_answer_like_an_unlimited_engine(tiny):
    """Ten conversations of different lengths take turns together under a budget of about a third of them:
    caches are evicted, restored, grown, shrunk and compacted, yet every reply equals an unlimited engine's,
    and after every round the device tier holds its caches' distinct keys and values (the shared system prompt
    once) and the rounding of each region to a unit, nothing more: within 12% of them."""
    with running_engine(tiny, device_cache_mb=kv_budget_mb(tiny, 900), max_batch=4) as small, \
            running_engine(tiny) as unlimited:
        limited = [Session(f"m{i}", system=SYSTEM) for i in range(10)]
        reference = [Session(f"m{i}", system=SYSTEM) for i in range(10)]
        for round_index in range(3):
            contents = [f"Question {round_index} from customer {i}: " + "tell me more. " * (4 + 3 * (i % 4))
                        for i in range(10)]
            lengths = [12 + 7 * ((i + round_index) % 5) for i in range(10)]
            got = run_together(small, limited, contents, lengths)
            expected = run_together(unlimited, reference, contents, lengths)
            for index, (result, wanted) in enumerate(zip(got, expected, strict=True)):
                assert result.token_ids == wanted.token_ids, f"session {index}, round {round_index + 1}"
            stats = small.cache.stats()
            regions = stats["device_sessions"] + stats["prefixes"]
            unit_bytes = UNIT * kv_budget_mb(tiny, 1) * 2**20
            assert stats["device_bytes"] <= stats["device_budget_bytes"]
            assert stats["device_kv_bytes"] <= stats["device_bytes"] < stats["device_kv_bytes"] + regions * unit_bytes
            assert stats["device_bytes"] <= 1.12 * stats["device_kv_bytes"], stats
        stats = small.cache.stats()
        assert stats.get("device_evictions", 0) > 0 and stats.get("restores", 0) > 0
