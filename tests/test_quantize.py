"""int8 host and remote tiers: the quantisation's error bound, the budget it buys, and every check
still catching a corrupted quantised cache."""

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from cache_store import CacheEntry, CacheLayout, CacheQuery, CacheStore, Offloader
from cache_store.checks.integrity import fingerprint
from cache_store.host.quantize import dequantize, quantize, quantized_nbytes
from cache_store.remote.remote_tier import RemoteTier
from cache_store.units import GROUP_TOKENS, key_groups
from tests.support import lookup_through_redis

LAYERS, HEADS, HEAD_DIM, TOKENS = 4, 3, 64, 200
LAYOUT = CacheLayout(LAYERS, HEADS, HEAD_DIM, torch.float32)
CACHE_BYTES = 2 * LAYERS * HEADS * TOKENS * HEAD_DIM * 4  # one float32 cache of TOKENS tokens


def kv(seed: int, tokens: int = TOKENS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Keys with outlier channels (as real keys have) and plain values."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(LAYERS):
        keys = torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator)
        keys[..., :4] *= 20  # a few channels carry large magnitudes
        pairs.append((keys, torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator)))
    return pairs


def entry(seed: int, owner: str) -> CacheEntry:
    cache = DynamicCache()
    for layer, (keys, values) in enumerate(kv(seed)):
        cache.update(keys, values, layer)
    made = CacheEntry(cache, list(range(seed, seed + TOKENS)))
    made.fingerprint = fingerprint(made, "test-model", owner, LAYOUT)
    return made


def store(host_kv_dtype: str, **kwargs) -> CacheStore:
    return CacheStore(new_cache=lambda tokens: DynamicCache(), offloader=Offloader(torch.device("cpu")), layout=LAYOUT,
                      model_key="test-model", device_budget_bytes=100 * CACHE_BYTES, host_kv_dtype=host_kv_dtype,
                      **kwargs)


def test_round_trip_error_is_within_half_a_step_per_channel_group_and_per_token():
    tensors = kv(0)
    quantized, scales = quantize(tensors)
    restored = dequantize(quantized, scales, torch.float32)
    groups = key_groups(TOKENS)
    for (keys, values), (key_scale, value_scale), (got_keys, got_values) in zip(tensors, scales, restored,
                                                                                 strict=True):
        assert quantized[0][0].dtype == torch.int8 and key_scale.shape == (1, HEADS, groups, HEAD_DIM)
        assert value_scale.shape == (1, HEADS, TOKENS, 1)
        step = key_scale.repeat_interleave(GROUP_TOKENS, dim=2)[:, :, :TOKENS]
        assert ((got_keys - keys).abs() <= step / 2 + 1e-6).all()  # rounding: at most half a step
        assert ((got_values - values).abs() <= value_scale / 2 + 1e-6).all()
        assert (got_values - values).norm() / values.norm() < 0.01
    assert quantized_nbytes(tensors) == sum(k.nbytes + v.nbytes for k, v in quantized + scales)


def test_a_restored_cache_grown_and_quantised_again_keeps_the_bytes_of_its_whole_groups():
    """Round trips do not add up: what was quantised once comes out the same (KIVI's groups, anchored at the
    cache's first position), so only the group that grew is quantised anew."""
    first = kv(4, tokens=5 * GROUP_TOKENS + 3)
    quantized, scales = quantize(first)
    restored = dequantize(quantized, scales, torch.float32)
    grown = [(torch.cat([keys, extra_keys], dim=2), torch.cat([values, extra_values], dim=2))
             for (keys, values), (extra_keys, extra_values) in zip(restored, kv(5, tokens=40), strict=True)]
    again, again_scales = quantize(grown)
    whole = 5 * GROUP_TOKENS
    for (keys, values), (keys_again, values_again), (key_scale, _), (key_scale_again, _) in zip(
            quantized, again, scales, again_scales, strict=True):
        assert torch.equal(keys_again[:, :, :whole], keys[:, :, :whole])
        assert torch.equal(values_again[:, :, :keys.shape[2]], values)
        assert torch.allclose(key_scale_again[:, :, :5], key_scale[:, :, :5], rtol=1e-6, atol=0)


def test_the_host_tier_holds_over_three_times_the_caches_at_the_same_budget():
    held = {}
    for dtype in ("same", "int8"):
        tier = store(dtype, host_budget_bytes=4 * CACHE_BYTES)
        for number in range(24):
            tier.put(f"s{number}", entry(number, f"s{number}"))
        tier.evict_idle()
        held[dtype] = sum(f"s{number}" in tier.host for number in range(24))
        assert tier.host.used_bytes() <= tier.host.budget_bytes
    # Each int8 cache is 3.4x smaller (the scales are 14% of it: keys per group of 16 tokens); the pool rounds both
    # to size classes.
    assert held["int8"] >= 3 * held["same"] > 0, held


def test_a_restored_int8_cache_is_close_marked_and_reported():
    tier = store("int8", host_budget_bytes=10 * CACHE_BYTES)
    original = entry(1, "s")
    exact = [(k.clone(), v.clone()) for k, v in original.tensors()]
    tier.put("s", original)
    tier.evict_idle()
    lookup = tier.lookup(CacheQuery("s", list(range(1, 1 + TOKENS)) + [7]))
    assert (lookup.source, lookup.cached_tokens, lookup.quantized) == ("host", TOKENS, "int8")
    for (keys, values), (got_keys, got_values) in zip(exact, lookup.entry.tensors(), strict=True):
        assert got_keys.dtype == torch.float32
        assert (got_values - values).norm() / values.norm() < 0.01 and (got_keys - keys).norm() / keys.norm() < 0.01
    tier.put("s", lookup.entry)
    assert tier.device.get("s").fingerprint.quantized == "int8"  # never exact again, after any write-back


@pytest.mark.parametrize("damage", ["int8 byte", "scale", "nan scale", "unmarked"])
def test_a_corrupted_int8_host_entry_is_caught(damage):
    tier = store("int8", host_budget_bytes=10 * CACHE_BYTES)
    tier.put("s", entry(2, "s"))
    tier.evict_idle()
    host_entry = tier.host._entries["s"].pieces()[0]  # (its first copy: nothing before it to restore)
    if damage == "int8 byte":
        host_entry.tensors[1][0].view(-1)[5] ^= 0x10
    elif damage == "scale":
        host_entry.scales[2][1].view(-1)[3] *= 1.5
    elif damage == "nan scale":
        host_entry.scales[0][0].view(-1)[0] = float("nan")
    else:  # claims to be exact
        host_entry.fingerprint = dataclasses.replace(host_entry.fingerprint, quantized=None)
    lookup = tier.lookup(CacheQuery("s", list(range(2, 2 + TOKENS)) + [7]))
    assert (lookup.source, lookup.miss_reason) == ("miss", "corrupt")
    assert lookup.cleared == {"int8 byte": ("checksum",), "scale": ("checksum",), "nan scale": ("checksum",),
                              "unmarked": ("fingerprint",)}[damage]


def test_redis_holds_under_a_third_of_the_bytes_and_a_flipped_byte_is_caught(redis_db):
    writer_tier = RemoteTier(redis_db.url, ttl_s=60)
    writer = store("same", host_budget_bytes=10 * CACHE_BYTES, remote=writer_tier, remote_kv_dtype="int8")
    writer.lookup(CacheQuery("s", [3, 4]))  # (a turn looks its cache up, then writes it back)
    writer.put("s", entry(3, "s"), session_version=1)
    writer_tier.close()  # flushes the background write
    reader_tier = RemoteTier(redis_db.url, ttl_s=60)
    header = reader_tier.head("s")
    assert header.fingerprint.quantized == "int8" and header.fetch_nbytes(0) < CACHE_BYTES / 3.4
    exact_only = store("same", host_budget_bytes=10 * CACHE_BYTES, remote=reader_tier)
    prompt = list(range(3, 3 + TOKENS)) + [7]
    assert lookup_through_redis(exact_only, "s", prompt, session_version=1).source == "miss", \
        "an int8 copy never passes for an exact one"
    reader = store("same", host_budget_bytes=10 * CACHE_BYTES, remote=reader_tier, remote_kv_dtype="int8")
    blob_key = "chatd:{s}:kv"
    raw = bytearray(reader_tier._redis.get(blob_key))
    raw[-10] ^= 0x01  # a byte of the last scale
    reader_tier._redis.set(blob_key, bytes(raw))
    lookup = lookup_through_redis(reader, "s", prompt, session_version=1)  # nothing measured yet: it fetches
    whole_chunks = TOKENS // reader_tier.chunk_tokens * reader_tier.chunk_tokens
    assert (lookup.source, lookup.cached_tokens, lookup.cleared) == ("remote", whole_chunks, ("checksum",)), \
        "restored up to the damaged tail"
    reader_tier.close()
