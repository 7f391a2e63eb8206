"""The cache boundary on CPU with hand-made caches: lookup outcomes, cropping and accounting."""

import torch
from transformers import DynamicCache

from cache_store import CacheEntry, CacheManager, common_prefix_length

LAYERS, HEADS, HEAD_DIM = 3, 2, 4


def make_entry(token_ids: list[int]) -> CacheEntry:
    cache = DynamicCache()
    n = len(token_ids)
    for layer in range(LAYERS):
        keys = torch.arange(n, dtype=torch.float32).repeat(1, HEADS, HEAD_DIM, 1).transpose(-1, -2)
        cache.update(keys + layer, keys - layer, layer)
    return CacheEntry(cache, list(token_ids))


def test_common_prefix_length():
    assert common_prefix_length([1, 2, 3], [1, 2, 4]) == 2
    assert common_prefix_length([1, 2], [1, 2, 3]) == 2
    assert common_prefix_length([], [1]) == 0
    assert common_prefix_length([5], [6]) == 0


def test_first_turn_is_a_miss_new():
    lookup = CacheManager().lookup("s", [1, 2, 3])
    assert (lookup.source, lookup.miss_reason, lookup.cached_tokens, lookup.entry) == ("miss", "new", 0, None)


def test_disabled_cache_never_reuses_nor_stores():
    manager = CacheManager(enabled=False)
    manager.store("s", make_entry([1, 2, 3]))
    lookup = manager.lookup("s", [1, 2, 3, 4])
    assert (lookup.source, lookup.miss_reason) == ("miss", "disabled")
    assert len(manager.device) == 0


def test_extension_reuses_every_cached_token():
    manager = CacheManager()
    manager.store("s", make_entry([1, 2, 3, 4]))
    lookup = manager.lookup("s", [1, 2, 3, 4, 5, 6])
    assert (lookup.source, lookup.cached_tokens) == ("device", 4)
    assert lookup.entry.is_consistent() and lookup.entry.token_ids == [1, 2, 3, 4]
    assert "s" not in manager.device, "a running turn owns its entry exclusively"


def test_divergent_render_is_cropped_to_the_common_prefix():
    manager = CacheManager()
    manager.store("s", make_entry([1, 2, 3, 4, 5]))
    lookup = manager.lookup("s", [1, 2, 9, 9, 9, 9])
    assert (lookup.source, lookup.cached_tokens) == ("device", 2)
    assert lookup.entry.token_ids == [1, 2]
    assert lookup.entry.seq_lengths() == [2] * LAYERS
    # The kept positions are the original ones, not shifted or recomputed.
    keys = lookup.entry.cache.layers[1].keys
    assert torch.equal(keys[0, 0, :, 0], torch.tensor([1.0, 2.0]))


def test_full_hit_still_leaves_the_last_prompt_token_to_feed():
    manager = CacheManager()
    manager.store("s", make_entry([1, 2, 3]))
    lookup = manager.lookup("s", [1, 2, 3])
    assert lookup.cached_tokens == 2 and lookup.entry.token_ids == [1, 2]


def test_nothing_in_common_is_a_miss_drift():
    manager = CacheManager()
    manager.store("s", make_entry([7, 8]))
    lookup = manager.lookup("s", [1, 2, 3])
    assert (lookup.source, lookup.miss_reason, lookup.entry) == ("miss", "drift", None)


def test_entry_bytes_count_the_tensors_storage():
    entry = make_entry(list(range(10)))
    per_token = 2 * LAYERS * HEADS * HEAD_DIM * 4
    assert entry.nbytes() >= 10 * per_token
    manager = CacheManager()
    manager.store("a", entry)
    assert manager.device.nbytes() == entry.nbytes()
    assert manager.drop("a") and not manager.drop("a")
