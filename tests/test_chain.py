"""The chain of a cache (shared segments, then its own region) and its reference counts, the device tier's
rules for segments, and the exact merge of partial attentions. No model needed."""

from __future__ import annotations

import pytest
import torch

from cache_store import CacheEntry, DeviceTier
from cache_store.device import chain
from cache_store.device.arena import UNIT, ArenaCache, KVArena
from cache_store.device.eviction import LRUPolicy
from chatd.engine import chain_attention
from chatd.engine.chain_attention import ChainPlan, matmul_attention, merge_partials, partial_attention

LAYERS, HEADS, HEAD_DIM = 2, 2, 4


def arena(tokens: int = 16 * UNIT) -> KVArena:
    return KVArena(LAYERS, HEADS, HEAD_DIM, torch.float64, torch.device("cpu"), tokens=tokens)


def filled(kv_arena: KVArena, tokens: int, seed: int = 0) -> ArenaCache:
    generator = torch.Generator().manual_seed(seed)
    cache = ArenaCache(kv_arena)
    cache.load([(torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator, dtype=torch.float64),
                 torch.randn(1, HEADS, tokens, HEAD_DIM, generator=generator, dtype=torch.float64))
                for _ in range(LAYERS)])
    return cache


def positions(cache: ArenaCache) -> list[torch.Tensor]:
    """Every position's keys and values, per layer, in order: what attention sees."""
    return [t for pair in chain.full_tensors(cache) for t in pair]


def same(a: list[torch.Tensor], b: list[torch.Tensor], tokens: int | None = None) -> bool:
    return all(torch.equal(x[:, :, :tokens], y[:, :, :tokens]) for x, y in zip(a, b, strict=True))


def test_a_split_shares_the_first_tokens_without_a_copy_and_counts_its_users():
    kv_arena = arena()
    source = filled(kv_arena, 2 * UNIT + 5)
    before = positions(source)
    free = kv_arena.allocator.free_units()
    segment = chain.split(source, UNIT)
    assert segment.frozen and source.prefix is segment and source.offset == UNIT
    assert (segment.used_tokens(), source.used_tokens(), source.get_seq_length()) == (UNIT, UNIT + 5, 2 * UNIT + 5)
    assert kv_arena.allocator.free_units() == free, "nothing allocated, nothing copied"
    assert same(positions(source), before) and chain.users(segment) == 1
    with pytest.raises(ValueError):
        chain.split(source, 3)  # not a whole unit, and not all of its own tokens


def test_start_from_shares_every_segment_within_the_tokens_and_copies_only_the_rest():
    kv_arena = arena()
    conversation = filled(kv_arena, 3 * UNIT + 3)
    expected = positions(conversation)
    policy = chain.split(conversation, UNIT)  # a system prompt
    branch_point = chain.split(conversation, 2 * UNIT)  # a second level: the history that a branch shares
    assert chain.segments(conversation) == [policy, branch_point] and branch_point.prefix is policy
    assert same(positions(conversation), expected)
    branch = ArenaCache(kv_arena)
    assert chain.start_from(branch, conversation, 3 * UNIT + 2) == 2 and branch.prefix is branch_point
    shallow = ArenaCache(kv_arena)
    assert chain.start_from(shallow, conversation, UNIT + 5) == 5 and shallow.prefix is policy
    assert same(positions(branch), expected, 3 * UNIT + 2) and same(positions(shallow), expected, UNIT + 5)
    assert (chain.users(policy), chain.users(branch_point)) == (2, 2)
    branch.release()
    shallow.release()
    assert (chain.users(policy), chain.users(branch_point)) == (1, 1), "a released cache stops counting at once"
    assert (policy.refs, branch_point.refs) == (2, 2), "each held by whoever split it and by its one user"


def test_a_crop_into_the_chain_copies_what_it_keeps_and_leaves_the_segments_alone():
    kv_arena = arena()
    cache = filled(kv_arena, 3 * UNIT)
    expected = positions(cache)
    segment = chain.split(cache, 2 * UNIT)
    kept = [t.clone() for t in positions(segment)]
    chain.crop(cache, 2 * UNIT + 4)  # within its own region: a length change
    assert cache.prefix is segment and cache.used_tokens() == 4
    chain.crop(cache, 7)  # into the segment
    assert cache.prefix is None and cache.used_tokens() == 7 and same(positions(cache), expected, 7)
    assert chain.users(segment) == 0 and same(positions(segment), kept)


def test_compaction_moves_a_segment_for_every_cache_that_starts_with_it():
    kv_arena = arena(8 * UNIT)
    spacer = filled(kv_arena, UNIT)
    source = filled(kv_arena, 2 * UNIT, seed=1)
    segment = chain.split(source, UNIT)
    users = []
    for seed in range(2):
        user = ArenaCache(kv_arena)
        chain.attach(user, segment)
        user.load([(torch.full((1, HEADS, UNIT, HEAD_DIM), float(seed)),) * 2 for _ in range(LAYERS)])
        users.append(user)
    expected = [positions(cache) for cache in (source, *users)]
    start = segment.region.start
    spacer.release()
    assert kv_arena.compact(4) and segment.region.start != start
    for cache, wanted in zip((source, *users), expected, strict=True):
        assert same(positions(cache), wanted)


def test_the_device_tier_keeps_a_segment_while_anything_starts_with_it_and_a_pinned_one_always():
    kv_arena = arena()
    tier = DeviceTier(budget_bytes=kv_arena.nbytes(), policy=LRUPolicy())
    system = filled(kv_arena, UNIT)
    warm = filled(kv_arena, UNIT, seed=2)
    segment, pinned = chain.split(system, UNIT), chain.split(warm, UNIT)
    tier.put("prefix:a", CacheEntry(segment, list(range(UNIT))))
    tier.put("prefix:warm", CacheEntry(pinned, list(range(UNIT))), pinned=True)
    tier.put("s1", CacheEntry(system, list(range(UNIT))))
    warm.release()
    assert not tier.is_evictable("prefix:a") and not tier.is_evictable("prefix:warm") and tier.is_evictable("s1")
    victims, fits = tier.plan_room(tier.budget_bytes)  # everything that can go
    assert victims == ["s1", "prefix:a"] and not fits, "a segment goes after the caches that start with it"
    tier.discard("s1")
    assert system.refs == 1 and not tier.is_evictable("prefix:a"), "its maker still holds s1, which starts with it"
    system.release()
    assert tier.is_evictable("prefix:a") and not tier.is_evictable("prefix:warm")


def attention_over_all(query, keys, values, scaling, visible=None, softcap=None, sinks=None):
    """The reference: one softmax over the concatenated keys (grouped heads repeated), sinks as one more column."""
    groups = query.shape[1] // keys.shape[0]
    keys, values = keys.repeat_interleave(groups, 0), values.repeat_interleave(groups, 0)
    scores = torch.einsum("rhqd,hkd->rhqk", query, keys) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if visible is not None:
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probabilities = scores.softmax(-1)[..., :keys.shape[1]]
    return torch.einsum("rhqk,hkd->rhqd", probabilities, values)


@pytest.mark.parametrize("softcap", [None, 20.0])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("kernel", [partial_attention, matmul_attention])  # (CPU: torch's fused flash kernel first)
def test_merging_partial_attentions_equals_attention_over_the_concatenation(softcap, with_sinks, kernel):
    torch.manual_seed(0)
    rows, heads, kv_heads, length, dim = 3, 4, 2, 5, 8
    query = torch.randn(rows, heads, length, dim, dtype=torch.float64)
    pieces = [(torch.randn(kv_heads, n, dim, dtype=torch.float64), torch.randn(kv_heads, n, dim, dtype=torch.float64))
              for n in (7, 1, 11)]
    visible = [torch.rand(rows, length, n) > 0.3 for n in (7, 1, 11)]
    visible[1][:] = False  # a piece some queries cannot see at all (outside their window)
    sinks = torch.randn(heads, dtype=torch.float64) if with_sinks else None
    parts = [kernel(query, k, v, 0.3, mask, softcap) for (k, v), mask in zip(pieces, visible, strict=True)]
    merged = merge_partials([o for o, _ in parts], [s for _, s in parts], sinks)
    expected = attention_over_all(query, torch.cat([k for k, _ in pieces], 1), torch.cat([v for _, v in pieces], 1),
                                  0.3, torch.cat(visible, -1), softcap, sinks)
    assert torch.allclose(merged, expected, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kernel", [partial_attention, matmul_attention])
def test_a_query_that_sees_nothing_in_a_piece_contributes_nothing_from_it(kernel):
    query = torch.randn(1, 2, 1, 4, dtype=torch.float64)
    keys = torch.randn(1, 3, 4, dtype=torch.float64)
    output, lse = kernel(query, keys, keys, 1.0, torch.zeros(1, 1, 3, dtype=torch.bool))
    assert torch.isneginf(lse).all() and torch.equal(output, torch.zeros_like(output))


@pytest.mark.parametrize("window", [None, 6])
@pytest.mark.parametrize("softcap", [None, 30.0])  # (None: the own pieces gathered into one call; else one a row)
@pytest.mark.parametrize("fold", [True, False])  # (the segment gathered with the own pieces, or read once)
def test_rows_of_any_length_attend_their_chain_exactly(window, softcap, fold, monkeypatch):
    """Three caches on one shared segment feed 1, 3 and 2 tokens in one pass (a token, and drafts to verify):
    each query sees the segment and its own positions up to its own, within its window, as one softmax would."""
    monkeypatch.setattr(chain_attention, "FOLD_LIMIT", chain_attention.FOLD_LIMIT if fold else 0)
    kv_arena = arena()
    first = filled(kv_arena, UNIT + 9, seed=1)
    policy = chain.split(first, UNIT)
    caches = [first]
    for keep in (UNIT + 4, UNIT + 7):
        caches.append(ArenaCache(kv_arena))
        chain.start_from(caches[-1], first, keep)
    counts = [1, 3, 2]
    generator = torch.Generator().manual_seed(2)
    for cache, count in zip(caches, counts, strict=True):  # the pass's new keys and values, written in place
        cache.reserve(cache.get_seq_length() + count)
        start = cache.region.start + cache.used_tokens()
        for buffer in (*kv_arena.keys, *kv_arena.values):
            buffer[:, start:start + count] = torch.randn(HEADS, count, HEAD_DIM, generator=generator,
                                                         dtype=torch.float64)
    query = torch.randn(1, 2 * HEADS, sum(counts), HEAD_DIM, generator=generator, dtype=torch.float64)
    plan = ChainPlan(kv_arena, caches, counts, torch.device("cpu"))
    assert plan.folded == fold
    for layer in range(LAYERS):
        got = plan.attend(layer, window, query, 0.4, softcap, None)  # [1, Q, Hq, D]
        first_query = 0
        for cache, count in zip(caches, counts, strict=True):
            own = slice(cache.region.start, cache.region.start + cache.used_tokens() + count)
            segment = slice(policy.region.start, policy.region.start + UNIT)
            keys = torch.cat([kv_arena.keys[layer][:, segment], kv_arena.keys[layer][:, own]], 1)
            values = torch.cat([kv_arena.values[layer][:, segment], kv_arena.values[layer][:, own]], 1)
            at = torch.arange(cache.get_seq_length(), cache.get_seq_length() + count)[:, None]
            seen = torch.arange(keys.shape[1])[None, :] <= at
            if window is not None:
                seen &= torch.arange(keys.shape[1])[None, :] > at - window
            expected = attention_over_all(query[:, :, first_query:first_query + count], keys, values, 0.4,
                                          seen[None], softcap)
            assert torch.allclose(got[:, first_query:first_query + count].transpose(1, 2), expected,
                                  atol=1e-10, rtol=1e-10)
            first_query += count
