"""The cache boundary on CPU with hand-made caches: lookups, eviction order, offload and restore,
shared prefixes, TTL and the budgets. No model needed."""

import random

import pytest
import torch
from transformers import DynamicCache

from cache_store import (
    CacheEntry,
    CacheLayout,
    CacheQuery,
    CacheStore,
    LRUPolicy,
    Offloader,
    SessionRunning,
    common_prefix_length,
)
from cache_store.device import chain
from cache_store.device.arena import ArenaCache, KVArena
from cache_store.host.host_pool import HostBufferPool, size_class

LAYERS, HEADS, HEAD_DIM = 3, 2, 4
BYTES_PER_TOKEN = 2 * LAYERS * HEADS * HEAD_DIM * 4  # float32
LAYOUT = CacheLayout(LAYERS, HEADS, HEAD_DIM, torch.float32)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        self.now += 1.0  # every reading is later than the last: recency is always strict
        return self.now


def make_entry(token_ids: list[int], seed: int = 0) -> CacheEntry:
    generator = torch.Generator().manual_seed(seed)
    cache = DynamicCache()
    for layer in range(LAYERS):
        keys = torch.randn(1, HEADS, len(token_ids), HEAD_DIM, generator=generator)
        cache.update(keys, keys * 2 + layer, layer)
    return CacheEntry(cache, list(token_ids))


def make_store(device_tokens: int = 1000, host_tokens: int = 1000, **kwargs) -> CacheStore:
    return CacheStore(new_cache=lambda tokens: DynamicCache(), offloader=Offloader(torch.device("cpu")), layout=LAYOUT,
                      model_key="test-model", device_budget_bytes=device_tokens * BYTES_PER_TOKEN,
                      host_budget_bytes=host_tokens * BYTES_PER_TOKEN, clock=kwargs.pop("clock", Clock()), **kwargs)


def ids(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0


def test_bytes_are_the_allocated_storage_and_match_the_formula():
    entry = make_entry(ids(10))
    assert entry.nbytes() == 10 * BYTES_PER_TOKEN
    entry.crop(4)
    assert entry.seq_lengths() == [4] * LAYERS
    assert entry.nbytes() == 10 * BYTES_PER_TOKEN, "a crop keeps the allocation"


def test_first_turn_is_a_miss_new_and_a_disabled_cache_never_stores():
    store = make_store()
    first = store.lookup(CacheQuery("s", [1, 2, 3]))
    assert (first.source, first.miss_reason) == ("miss", "new")
    store.abandon("s")
    assert store.lookup(CacheQuery("s", [1, 2])) == first
    disabled = make_store(enabled=False)
    disabled.put("s", make_entry(ids(3)))
    assert disabled.lookup(CacheQuery("s", ids(4))).miss_reason == "disabled" and len(disabled.device) == 0


def test_extension_reuses_every_cached_token_and_marks_the_cache_running():
    store = make_store()
    store.put("s", make_entry([1, 2, 3, 4]))
    lookup = store.lookup(CacheQuery("s", [1, 2, 3, 4, 5, 6]))
    assert (lookup.source, lookup.cached_tokens, lookup.entry.token_ids) == ("device", 4, [1, 2, 3, 4])
    assert store.device.residency("s").running
    store.put("s", lookup.entry)
    assert not store.device.residency("s").running


def test_divergence_crops_to_the_common_prefix_and_keeps_the_original_values():
    store = make_store()
    original = make_entry([1, 2, 3, 4, 5])
    expected = original.cache.layers[1].keys[..., :2, :].clone()
    store.put("s", original)
    lookup = store.lookup(CacheQuery("s", [1, 2, 9, 9, 9, 9]))
    assert (lookup.source, lookup.cached_tokens, lookup.entry.token_ids) == ("device", 2, [1, 2])
    assert lookup.entry.seq_lengths() == [2] * LAYERS
    assert torch.equal(lookup.entry.cache.layers[1].keys, expected)


def test_full_hit_leaves_the_last_prompt_token_and_nothing_in_common_is_drift():
    store = make_store()
    store.put("s", make_entry([1, 2, 3]))
    assert store.lookup(CacheQuery("s", [1, 2, 3])).cached_tokens == 2
    store.put("t", make_entry([7, 8]))
    lookup = store.lookup(CacheQuery("t", [1, 2, 3]))
    assert (lookup.source, lookup.miss_reason, "t" in store.device) == ("miss", "drift", False)


def test_eviction_order_disconnected_first_then_least_recent_never_running():
    store = make_store(device_tokens=30)
    for name in "abc":
        store.put(name, make_entry(ids(10)))
    store.touch("b", connected=True)
    store.put("d", make_entry(ids(10)))  # evicts a: disconnected and least recent
    store.put("e", make_entry(ids(10)))  # evicts c, not b: b is connected although older
    running = store.lookup(CacheQuery("d", ids(11)))
    store.put("f", make_entry(ids(10)))  # evicts e: d is running
    store.put("g", make_entry(ids(10)))  # evicts f
    store.touch("g", connected=True)
    store.put("h", make_entry(ids(10)))  # evicts b: connected like g, but less recent
    assert store.host.keys() == ["a", "c", "e", "f", "b"]
    assert "d" in store.device and running.entry is store.device.get("d")
    assert store.device.used_bytes() <= store.device.budget_bytes


def test_the_policy_is_pluggable():
    store = make_store(device_tokens=20, policy=LRUPolicy())
    store.put("a", make_entry(ids(10)))
    store.touch("a", connected=True)
    store.put("b", make_entry(ids(10)))
    store.put("c", make_entry(ids(10)))
    assert store.host.keys() == ["a"], "plain LRU ignores the connection"


def test_offload_then_restore_is_bit_for_bit_equal():
    store = make_store(device_tokens=10)
    evicted = make_entry(ids(10), seed=3)
    expected = [(k.clone(), v.clone()) for k, v in evicted.tensors()]
    store.put("a", evicted)
    store.put("b", make_entry(ids(10)))
    assert "a" in store.host and "a" not in store.device
    lookup = store.lookup(CacheQuery("a", ids(12)))
    assert (lookup.source, lookup.cached_tokens) == ("host", 10)
    assert lookup.entry.token_ids == ids(10) and lookup.entry.is_consistent()
    for (k, v), (k0, v0) in zip(lookup.entry.tensors(), expected, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0) and k.dtype == k0.dtype
    # Its host copy stays (first to go), so that its next offload copies only what a turn adds.
    assert "a" in store.host and store.counters["restores"] == 1


@pytest.mark.parametrize("kv_dtype", ["same", "int8"])
def test_an_offload_after_a_turn_copies_only_what_the_turn_added(kv_dtype):
    """The host copy a cache was restored from stays, and the next offload writes only the positions after it
    (int8 positions are quantised once); a restore reads the chain back exactly as the device held it."""
    store = make_store(device_tokens=24, host_kv_dtype=kv_dtype)
    store.put("a", make_entry(ids(20), seed=3))
    store.put("b", make_entry(ids(20), seed=4))  # evicts a
    first_bytes = store.counters["host_offload_bytes"]
    lookup = store.lookup(CacheQuery("a", ids(21)))
    assert lookup.source == "host"
    first_copy = store.host.get("a")
    entry, grown = lookup.entry, make_entry(ids(6, start=100), seed=5)
    for layer, (keys, values) in enumerate(grown.tensors()):  # a turn's new positions
        entry.cache.update(keys, values, layer)
    entry.token_ids = ids(20) + ids(6, start=100)
    expected = [(k.clone(), v.clone()) for k, v in entry.tensors()]
    store.put("a", entry, session_version=1)  # evicts b, then a goes again
    store.put("c", make_entry(ids(20), seed=6))
    chain = store.host.get("a")
    assert chain.base is first_copy and chain.own_tokens == 6 and len(chain.pieces()) == 2
    assert store.counters["host_offload_bytes"] - 2 * first_bytes < first_bytes / 2  # 6 positions, not 26
    restored = store.lookup(CacheQuery("a", ids(20) + ids(6, start=100) + [7]))
    assert (restored.source, restored.cached_tokens) == ("host", 26)
    for (k, v), (k0, v0) in zip(restored.entry.tensors(), expected, strict=True):
        if kv_dtype == "same":
            assert torch.equal(k, k0) and torch.equal(v, v0)
        else:  # the first 20 positions were dequantised already: quantised once, they come back the same
            assert torch.equal(k[:, :, :20], k0[:, :, :20]) and torch.equal(v[:, :, :20], v0[:, :, :20])
            assert (v[:, :, 20:] - v0[:, :, 20:]).norm() / v0[:, :, 20:].norm() < 0.02
    chain.base.tensors[0][0].view(-1)[3] += 1  # damage in the older copy is caught too
    store.put("a", restored.entry, session_version=1)
    store.put("d", make_entry(ids(20), seed=7))
    store.put("e", make_entry(ids(20), seed=8))
    assert store.lookup(CacheQuery("a", ids(27))).miss_reason == "corrupt"


def test_a_damaged_later_copy_restores_the_chain_up_to_its_last_good_copy():
    """Only what the damaged copy held is recomputed: the turn reuses the copies before it, and says what
    failed."""
    store = make_store(device_tokens=24)
    first = make_entry(ids(20), seed=3)
    expected = [(k.clone(), v.clone()) for k, v in first.tensors()]
    store.put("a", first)
    store.put("b", make_entry(ids(20), seed=4))
    entry = store.lookup(CacheQuery("a", ids(21))).entry
    for layer, (keys, values) in enumerate(make_entry(ids(6, start=100), seed=5).tensors()):
        entry.cache.update(keys, values, layer)
    entry.token_ids = ids(20) + ids(6, start=100)
    store.put("a", entry, session_version=1)
    store.put("c", make_entry(ids(20), seed=6))
    store.host.get("a").tensors[2][1].view(-1)[0] += 1  # the turn's copy, not the first
    lookup = store.lookup(CacheQuery("a", ids(20) + ids(6, start=100) + [7]))
    assert (lookup.source, lookup.cached_tokens, lookup.cleared) == ("host", 20, ("checksum",))
    for (k, v), (k0, v0) in zip(lookup.entry.tensors(), expected, strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert store.counters["corrupt_checksum"] == 1


def test_a_full_host_tier_drops_the_least_recent_and_its_next_turn_is_a_miss_evicted():
    store = make_store(device_tokens=10, host_tokens=10)
    for name in "abc":
        store.put(name, make_entry(ids(10)))
    assert store.host.keys() == ["b"] and "c" in store.device
    lookup = store.lookup(CacheQuery("a", ids(12)))
    assert (lookup.source, lookup.miss_reason) == ("miss", "evicted")
    assert store.counters["host_evictions"] == 1


def test_a_cache_larger_than_the_device_budget_goes_to_the_host_tier():
    store = make_store(device_tokens=5)
    store.put("big", make_entry(ids(8)))
    assert "big" in store.host and store.device.used_bytes() == 0


def arena_store(tokens: int = 1000, **kwargs) -> tuple[CacheStore, KVArena]:
    """A store whose caches are regions of a KV arena (shared segments live only there)."""
    arena = KVArena(LAYERS, HEADS, HEAD_DIM, torch.float32, torch.device("cpu"), tokens=tokens)
    store = CacheStore(new_cache=lambda n: ArenaCache(arena), offloader=Offloader(torch.device("cpu")), layout=LAYOUT,
                       model_key="test-model", device_budget_bytes=tokens * BYTES_PER_TOKEN,
                       host_budget_bytes=tokens * BYTES_PER_TOKEN, clock=Clock(), **kwargs)
    return store, arena


def arena_entry(arena: KVArena, token_ids: list[int], seed: int = 0) -> CacheEntry:
    cache = ArenaCache(arena)
    cache.load(make_entry(token_ids, seed).tensors())
    return CacheEntry(cache, list(token_ids))


def test_a_shared_prefix_starts_new_sessions_without_a_copy_and_is_never_mutated():
    store, arena = arena_store()
    system = arena_entry(arena, ids(20), seed=9)
    original = [k.clone() for k, _ in system.tensors()]
    assert store.put_prefix(system)
    assert (system.prefix_tokens, system.own_tokens) == (16, 4), "whole units shared, the rest kept"
    segment = system.cache.prefix
    lookup = store.lookup(CacheQuery("new", ids(24), prefix_len=20))
    assert (lookup.source, lookup.cached_tokens) == ("prefix", 16)
    assert lookup.entry.cache.prefix is segment and lookup.entry.own_tokens == 0, "nothing copied"
    assert chain.users(segment) == 2
    with pytest.raises(RuntimeError, match="read-only"):
        segment.layers[0].update(original[0], original[0])
    lookup.entry.crop(2)  # a crop into the segment copies what it keeps, and leaves the segment alone
    assert (lookup.entry.prefix_tokens, lookup.entry.own_tokens) == (0, 2) and chain.users(segment) == 1
    assert lookup.entry.tensors()[0][0].equal(original[0][:, :, :2])
    lookup.entry.cache.layers[0].keys.zero_()
    again = store.lookup(CacheQuery("other", ids(25), prefix_len=20))
    assert again.entry.cache.prefix is segment and segment.layers[0].keys.equal(original[0][:, :, :16])
    assert store.lookup(CacheQuery("third", ids(20, start=1) + [0, 0], prefix_len=20)).source == "miss", \
        "ids are verified"
    assert store.lookup(CacheQuery("fourth", ids(24), prefix_len=20, owner="another key")).source == "miss", \
        "owners apart"
    assert store.stats()["prefixes"] == 1 and store.stats()["segment_users"] == 2


def test_ttl_drops_idle_disconnected_caches_only():
    clock = Clock()
    store = make_store(device_tokens=10, ttl_s=100, clock=clock)
    store.put("idle", make_entry(ids(10)))
    store.put("offloaded", make_entry(ids(10)))
    store.put("connected", make_entry(ids(10)))
    store.touch("connected", connected=True)
    clock.now += 150
    assert sorted(store.expire()) == ["idle", "offloaded"]
    assert "connected" in store.device and len(store.host) == 0
    assert store.lookup(CacheQuery("idle", ids(11))).miss_reason == "evicted"


def test_an_empty_write_back_keeps_the_connection_state_and_forget_clears_it():
    store = make_store(device_tokens=20)
    store.touch("a", connected=True)
    store.put("a", make_entry([]))  # a cancelled first turn leaves nothing to keep
    store.put("a", make_entry(ids(10)))
    assert store.device.residency("a").connected
    store.forget("a")
    store.put("a", make_entry(ids(10)))
    assert not store.device.residency("a").connected


def test_prefetch_restores_a_host_cache_but_never_evicts_a_running_one():
    store = make_store(device_tokens=10)
    store.put("a", make_entry(ids(10)))
    store.put("b", make_entry(ids(10)))
    assert store.prefetch("a") and "a" in store.device and "b" in store.host
    assert not store.prefetch("a"), "already on the device"
    assert not store.prefetch("unknown")
    store.lookup(CacheQuery("a", ids(11)))  # a is running now
    assert not store.prefetch("b") and "b" in store.host and "a" in store.device


def test_a_running_cache_is_never_handed_to_a_second_turn():
    store = make_store()
    store.put("s", make_entry([1, 2, 3, 4]))
    first_turn = object()
    assert store.admit("s", first_turn, 10 * BYTES_PER_TOKEN)
    lookup = store.lookup(CacheQuery("s", [1, 2, 3, 4, 5]), turn=first_turn)
    assert lookup.source == "device"
    with pytest.raises(SessionRunning):
        store.lookup(CacheQuery("s", [1, 2, 3, 4, 5]), turn=object())
    with pytest.raises(SessionRunning):
        store.lookup(CacheQuery("s", [1, 2, 3, 4, 5]))
    with pytest.raises(SessionRunning):
        store.admit("s", object(), 0)
    store.put("s", lookup.entry)
    assert store.lookup(CacheQuery("s", [1, 2, 3, 4, 5])).source == "device", "free again after write-back"


def test_a_running_turn_counts_at_the_size_it_may_reach_from_its_admission():
    store = make_store(device_tokens=30)
    store.put("a", make_entry(ids(10)))
    store.put("b", make_entry(ids(10)))
    assert store.admit("new", object(), 20 * BYTES_PER_TOKEN)  # a miss: nothing on the device yet
    assert store.host.keys() == ["a"] and store.device.used_bytes() == 30 * BYTES_PER_TOKEN
    assert store.stats()["device_reserved_bytes"] == 20 * BYTES_PER_TOKEN
    assert not store.admit("later", object(), 25 * BYTES_PER_TOKEN), "waits: only a running turn could make room"
    assert "b" in store.device, "nothing was evicted for a turn that still does not fit"
    store.put("new", make_entry(ids(18)))
    assert store.admit("later", object(), 25 * BYTES_PER_TOKEN)
    assert store.device.used_bytes() <= store.device.budget_bytes


def test_a_turn_alone_is_admitted_over_the_budget_and_its_cache_leaves_the_device_at_write_back():
    store = make_store(device_tokens=10)
    store.put("a", make_entry(ids(5)))
    assert store.admit("big", object(), 40 * BYTES_PER_TOKEN, alone=True)
    assert "a" in store.host, "every idle cache made room"
    store.put("big", make_entry(ids(30)))
    assert "big" in store.host and store.device.used_bytes() == 0


def test_a_value_changed_in_a_resident_cache_is_caught_by_its_checksum():
    store = make_store()
    store.put("s", make_entry(ids(10)))
    store.device.get("s").cache.layers[1].values[0, 0, 3, 1] += 1e-3
    lookup = store.lookup(CacheQuery("s", ids(12)))
    assert (lookup.source, lookup.miss_reason, lookup.cleared) == ("miss", "corrupt", ("checksum",))
    assert "s" not in store.device


def test_a_resident_cache_changed_before_its_offload_never_enters_the_host_tier():
    store = make_store(device_tokens=10)
    store.put("a", make_entry(ids(10)))
    store.device.get("a").cache.layers[0].keys[0, 1, 0, 0] = 7.0
    store.put("b", make_entry(ids(10)))  # evicts a
    assert "a" not in store.host and store.counters["corrupt_checksum"] == 1


def test_host_buffers_are_reused_and_the_budget_counts_what_is_held():
    store = make_store(device_tokens=10, host_tokens=25)
    for name in "abcde":
        store.put(name, make_entry(ids(10)))
    pool = store.host.pool
    assert store.host.keys() == ["c", "d"], "a third buffer would not fit 25 tokens"
    assert pool.held_bytes == 2 * size_class(10 * BYTES_PER_TOKEN) == store.host.used_bytes()
    store.lookup(CacheQuery("c", ids(11)))  # restored (e made room for it); its host copy stays, first to go
    assert store.host.keys() == ["c", "e"] and store.host.used_bytes() == pool.held_bytes
    store.put("f", make_entry(ids(10)))  # c's copy goes first, and f reuses its buffer rather than holding more
    assert store.host.keys() == ["e", "f"]
    store.put("g", make_entry(ids(10)))
    assert pool.held_bytes == 2 * size_class(10 * BYTES_PER_TOKEN) and pool.free_bytes == 0


@pytest.mark.parametrize("seed", range(20))
def test_budgets_are_never_exceeded(seed):
    rng = random.Random(seed)
    store = make_store(device_tokens=60, host_tokens=80, ttl_s=50)
    sessions = [f"s{i}" for i in range(8)]
    history = {s: [] for s in sessions}
    for _ in range(300):
        session = rng.choice(sessions)
        action = rng.random()
        if action < 0.5:  # a turn: lookup, grow, write back
            prompt = history[session] + ids(rng.randint(1, 8), start=1000)
            turn = object()
            assert store.admit(session, turn, (len(prompt) + 4) * BYTES_PER_TOKEN)
            store.lookup(CacheQuery(session, prompt), turn=turn)
            assert store.device.used_bytes() <= store.device.budget_bytes
            grown = prompt + ids(rng.randint(0, 4), start=2000)
            if len(grown) <= 30:
                store.put(session, make_entry(grown))
                history[session] = grown
            else:
                store.abandon(session)
                history[session] = []
        elif action < 0.65:
            store.prefetch(session)
        elif action < 0.8:
            store.touch(session, connected=rng.random() < 0.5)
        elif action < 0.9:
            store.expire()
        else:
            (store.drop if rng.random() < 0.5 else store.forget)(session)
            history[session] = []
        assert store.device.used_bytes() <= store.device.budget_bytes
        assert store.host.used_bytes() <= store.host.budget_bytes
        for key in store.device:
            assert store.device.get(key).is_consistent()


def test_a_pinned_allocation_that_fails_falls_back_to_ordinary_memory_with_one_warning(caplog):
    pool = HostBufferPool(pinned=True)  # no CUDA here: every pinned allocation fails
    buffers = [pool.take(1000), pool.take(5000)]
    assert not any(buffer.is_pinned() for buffer in buffers)
    assert [r.levelname for r in caplog.records] == ["WARNING"] and "pinned" in caplog.records[0].getMessage()
    for buffer in buffers:
        pool.give(buffer)
    assert pool.held_bytes == size_class(1000) + size_class(5000) == pool.free_bytes
    assert pool.release_free() == size_class(1000) + size_class(5000)
    assert pool.held_bytes == pool.free_bytes == 0


def test_the_host_tier_drops_a_segment_nothing_starts_with_first_then_sessions_then_segments():
    from cache_store.host.host_pool import size_class
    from cache_store.host.host_tier import HostTier
    from cache_store.host.offload import HostEntry

    def host_copy(prefix_key: str | None = None) -> HostEntry:
        tensors = [(keys.clone(), values.clone()) for keys, values in make_entry(ids(64)).tensors()]
        return HostEntry(tensors, ids(64), None, "", prefix_key=prefix_key)

    one = host_copy().nbytes
    tier = HostTier(budget_bytes=4 * one)
    for key, copy in (("prefix:unused", host_copy()), ("prefix:used", host_copy()), ("old", host_copy("prefix:used")),
                      ("new", host_copy("prefix:used"))):
        tier.put(key, copy)

    def needed(key: str) -> bool:
        return any(tier.get(other).prefix_key == key for other in tier.keys())

    assert one == size_class(one)
    assert tier.make_room(one, needed=needed) == (["prefix:unused"], True), "what no session needs first"
    assert tier.make_room(2 * one, needed=needed) == (["old"], True), "then the oldest sessions"
    assert tier.make_room(3 * one, needed=needed) == (["new"], True)
    assert tier.make_room(4 * one, needed=needed) == (["prefix:used"], True), "segments last"


def offload_two_sessions(scopes: tuple[str | None, str | None] = (None, None), shared: int = 70):
    """Two sessions whose histories share their first `shared` ids (keys and values too, as the model gives
    them), each offloaded after its first turn."""
    store = make_store(device_tokens=120, host_tokens=1000)
    entries = {}
    for session, scope, tail_start in (("a", scopes[0], 500), ("b", scopes[1], 600)):
        token_ids = ids(shared) + ids(100 - shared, start=tail_start)
        entry = make_entry(token_ids, seed=1)
        for (keys, values), (other_keys, other_values) in zip(entry.tensors(), make_entry(token_ids, seed=len(session)
                                                                                           + tail_start).tensors(),
                                                               strict=True):
            keys[..., shared:, :], values[..., shared:, :] = other_keys[..., shared:, :], other_values[..., shared:, :]
        entries[session] = [(k.clone(), v.clone()) for k, v in entry.tensors()]
        store.lookup(CacheQuery(session, [*token_ids, 7], prefix_len=shared, owner=scope))  # (their system prompt)
        store.put(session, entry)
        store.evict_idle()
    return store, entries


def test_sessions_of_one_owner_share_the_host_copy_of_their_common_start_and_restore_exactly():
    store, expected = offload_two_sessions()
    first, second = store.host.get("a"), store.host.get("b")
    shared = first.pieces()[0]
    assert shared.name is not None and second.pieces()[0] is shared and shared.refs == 2
    assert len(shared.token_ids) == 64, "up to the last chunk's edge the two share (70 ids in common)"
    assert store.stats()["host_chunk_copies_shared"] == 1
    # the second offload copied only its positions after the shared copy: 36 of 100
    assert store.counters["host_offload_bytes"] == (100 + 36) * BYTES_PER_TOKEN
    for session in ("a", "b"):
        found = store.lookup(CacheQuery(session, [*store.host.get(session).token_ids, 7]))
        assert (found.source, found.cached_tokens) == ("host", 100)
        assert all(torch.equal(k, k0) and torch.equal(v, v0)
                   for (k, v), (k0, v0) in zip(found.entry.tensors(), expected[session], strict=True))


def test_two_owners_never_share_a_host_copy():
    store, _ = offload_two_sessions(scopes=("key-a", "key-b"))
    assert store.host.get("a").pieces()[0] is not store.host.get("b").pieces()[0]
    assert store.stats()["host_chunk_copies"] == 2 and store.stats()["host_chunk_copies_shared"] == 0


def test_a_damaged_shared_host_copy_is_caught_by_every_session_on_it_and_never_continued():
    store, _ = offload_two_sessions()
    shared = store.host.get("a").pieces()[0]
    shared.tensors[0][0].view(-1)[0] += 1
    prompts = {session: [*store.host.get(session).token_ids, 7] for session in ("a", "b")}
    for session in ("a", "b"):
        found = store.lookup(CacheQuery(session, prompts[session]))
        assert (found.source, found.miss_reason, found.cleared) == ("miss", "corrupt", ("checksum",))
        store.release(session)
    assert store.host.named([shared.name]) is None and store.counters["corrupt_checksum"] == 2


def test_a_named_host_copy_no_session_includes_is_the_first_to_go():
    store, _ = offload_two_sessions()
    shared = store.host.get("a").pieces()[0]
    store.host.discard("a")
    store.host.discard("b")
    assert shared.refs == 0 and store.host.named([shared.name]) is shared, "kept for later offloads to continue"
    store.put("c", make_entry(ids(100, start=900)))
    store.evict_idle()
    store.host.pool.release_free()  # (what the two sessions held, free now, goes first anyway)
    held = store.host.used_bytes()
    assert store.host.make_room(store.host.budget_bytes - held + 1) == ([], True)
    assert store.host.named([shared.name]) is None and "c" in store.host, "the unused copy went, not c"


def test_a_restore_keeps_its_named_copies_while_room_is_made_for_it():
    """Making room on the device for a restore offloads another cache, whose room on the host must never come from
    the copies being restored (named, and no longer in the tier while they are read)."""
    store = make_store(device_tokens=110, host_tokens=150)
    entry = make_entry(ids(100), seed=1)
    expected = [(k.clone(), v.clone()) for k, v in entry.tensors()]
    store.lookup(CacheQuery("a", ids(101), prefix_len=70))
    store.put("a", entry)
    store.evict_idle()
    assert [piece.name is not None for piece in store.host.get("a").pieces()] == [True, False]
    store.put("b", make_entry(ids(100, start=500), seed=2))
    found = store.lookup(CacheQuery("a", ids(101)))  # evicts b, which no longer fits on the host
    assert (found.source, found.cached_tokens) == ("host", 100)
    assert all(torch.equal(k, k0) and torch.equal(v, v0)
               for (k, v), (k0, v0) in zip(found.entry.tensors(), expected, strict=True))
    assert "b" not in store.host and store.counters["host_evictions"] == 1


def test_only_running_turns_and_pinned_prompts_count_as_in_use_as_vllm_counts_blocks():
    """`device_active_bytes` (what `vllm:kv_cache_usage_perc` reads): a running turn counts at the size it may reach,
    an idle cached session counts as free room, as vLLM's unreferenced prefix-cache blocks do."""
    store = make_store()
    turn = object()
    assert store.admit("s", turn, 30 * BYTES_PER_TOKEN)
    assert store.stats()["device_active_bytes"] == 30 * BYTES_PER_TOKEN
    store.put("s", make_entry(ids(20)))
    stats = store.stats()
    assert stats["device_active_bytes"] == 0 < stats["device_bytes"], "an idle cache is free room"
