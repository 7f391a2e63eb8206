"""Each consistency check on hand-made caches, including the corruptions LMCache tests for: a
flipped byte, a frame for the wrong session, a truncated frame."""

import torch
from transformers import DynamicCache

from cache_store import CacheLayout, CacheQuery, Offloader
from cache_store.checks.integrity import check_finite, check_identity, check_tensors, checksum, fingerprint
from tests.test_cache_store import HEAD_DIM, HEADS, LAYERS, LAYOUT, ids, make_entry, make_store


def test_a_healthy_cache_passes_every_check():
    entry = make_entry(ids(6))
    stamp = fingerprint(entry, "model", "s", LAYOUT)
    assert check_identity(stamp, "model", "s", entry.token_ids, LAYOUT) is None
    assert check_tensors(entry.tensors(), entry.num_tokens, LAYOUT) is None
    assert check_finite(entry.tensors()) is None


def test_fingerprint_names_the_wrong_owner_model_tokens_or_layout():
    entry = make_entry(ids(6))
    stamp = fingerprint(entry, "model", "s", LAYOUT)
    assert check_identity(stamp, "model", "other-session", entry.token_ids, LAYOUT) == "fingerprint"
    assert check_identity(stamp, "other-model", "s", entry.token_ids, LAYOUT) == "fingerprint"
    assert check_identity(stamp, "model", "s", ids(6, start=1), LAYOUT) == "fingerprint"
    assert check_identity(stamp, "model", "s", ids(5), LAYOUT) == "fingerprint"
    half = CacheLayout(LAYERS, HEADS, HEAD_DIM, torch.float16)
    assert check_identity(stamp, "model", "s", entry.token_ids, half) == "fingerprint"
    assert check_identity(None, "model", "s", entry.token_ids, LAYOUT) == "fingerprint"


def test_length_and_shape_checks():
    entry = make_entry(ids(6))
    assert check_tensors(entry.tensors(), 7, LAYOUT) == "length"
    truncated = entry.tensors()
    truncated[1] = (truncated[1][0][..., :-1, :], truncated[1][1])
    assert check_tensors(truncated, 6, LAYOUT) == "length"
    headless = entry.tensors()
    headless[0] = (headless[0][0][:, :1], headless[0][1][:, :1])
    assert check_tensors(headless, 6, LAYOUT) == "shape"
    assert check_tensors(entry.tensors()[:-1], 6, LAYOUT) == "shape", "a missing layer"
    wrong_dtype = [(k.double(), v.double()) for k, v in entry.tensors()]
    assert check_tensors(wrong_dtype, 6, LAYOUT) == "shape"


def test_finite_check_finds_nan_and_inf_in_any_layer():
    for bad in (float("nan"), float("inf"), float("-inf")):
        entry = make_entry(ids(6))
        entry.cache.layers[2].values[0, 1, 3, 2] = bad
        assert check_finite(entry.tensors()) == "finite"
    half = [(k.half() * 1000, v.half() * 1000) for k, v in make_entry(ids(6)).tensors()]
    assert check_finite(half) is None, "sums run in float32: large half values do not overflow"


def test_checksum_catches_a_flipped_byte_and_a_truncated_frame():
    tensors = Offloader(torch.device("cpu")).offload(make_entry(ids(6))).tensors
    before = checksum(tensors)
    tensors[1][0].view(torch.uint8)[0, 0, 0, 5] ^= 0x10
    assert checksum(tensors) != before
    tensors[1] = (tensors[1][0], tensors[1][1][..., :-1, :])
    assert checksum(tensors) != before


def test_the_store_clears_a_corrupt_cache_in_every_tier_and_names_the_check():
    store = make_store(device_tokens=10)
    store.put("a", make_entry(ids(10)))
    store.put("b", make_entry(ids(10), seed=1))  # a goes to the host tier
    host_tensors = store.host.get("a").tensors
    host_tensors[0][0].view(torch.uint8)[0, 0, 0, 0] ^= 1  # a flipped byte in host memory
    lookup = store.lookup(CacheQuery("a", ids(12)))
    assert (lookup.source, lookup.miss_reason, lookup.cleared) == ("miss", "corrupt", ("checksum",))
    assert "a" not in store.host and "a" not in store.device
    assert store.counters["corrupt_checksum"] == 1
    store.abandon("a")  # that turn ended without a write-back
    assert store.lookup(CacheQuery("a", ids(12))).miss_reason == "new", "the next turn starts clean"


def test_a_frame_for_the_wrong_session_is_refused():
    store = make_store()
    store.put("a", make_entry(ids(6)))
    store.put("b", make_entry(ids(6), seed=2))
    store.device.put("a", store.device.get("b").clone(lambda tokens: DynamicCache()))  # b's cache served as a's
    lookup = store.lookup(CacheQuery("a", ids(8)))
    assert (lookup.miss_reason, lookup.cleared) == ("corrupt", ("fingerprint",))


def test_a_prefetch_of_a_corrupt_cache_clears_it_quietly():
    store = make_store(device_tokens=10)
    store.put("a", make_entry(ids(10)))
    store.put("b", make_entry(ids(10)))
    store.host.get("a").token_ids[0] = 999
    assert not store.prefetch("a")
    assert "a" not in store.host and store.counters["corrupt_fingerprint"] == 1
