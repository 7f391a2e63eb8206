"""The prefix index in a real Redis: what one worker indexes another finds, owners never meet, a shortened
conversation leaves its old blocks, keys expire with the sessions and are Cluster-safe, and an unreachable
Redis leaves each worker its own index."""

import redis.asyncio as redis

from sessions.encoding import prefix_block_key
from sessions.prefix_index import BLOCK, MAX_CANDIDATES, block_hashes
from sessions.shared_prefix_index import SharedPrefixIndex

SYSTEM = list(range(1000, 1000 + 3 * BLOCK))  # a system prompt three blocks long
RETENTION_S = 600


def two_workers(url: str) -> tuple[SharedPrefixIndex, SharedPrefixIndex, redis.Redis]:
    """Two workers' indexes on one Redis, each with its own connection and its own memory."""
    return (SharedPrefixIndex(redis.Redis.from_url(url), RETENTION_S),
            SharedPrefixIndex(redis.Redis.from_url(url), RETENTION_S), redis.Redis.from_url(url))


async def test_what_one_worker_indexes_another_finds_deepest_first(redis_db):
    first, second, _ = two_workers(redis_db.url)
    await first.add("key-a", "short", SYSTEM + [1] * BLOCK)
    await first.add("key-a", "long", SYSTEM + [1] * BLOCK + [2] * BLOCK)
    await first.add("key-a", "other", SYSTEM + [3] * BLOCK)
    assert (await second.candidates("key-a", SYSTEM + [1] * BLOCK + [2] * BLOCK + [4] * 5))[0] == "long"
    assert set((await second.candidates("key-a", SYSTEM + [1] * BLOCK))[:2]) == {"short", "long"}
    assert (await second.candidates("key-a", SYSTEM + [3] * BLOCK))[0] == "other"
    assert await second.candidates("key-a", [7] * (BLOCK - 1)) == []  # less than a block: nothing to match
    assert len(second.local) == 0, "the second worker found them in Redis, not in its memory"


async def test_another_owner_never_matches_through_redis(redis_db):
    first, second, _ = two_workers(redis_db.url)
    await first.add("key-a", "mine", SYSTEM + [1] * BLOCK)
    assert await second.candidates("key-b", SYSTEM + [1] * BLOCK) == []
    assert await second.candidates(None, SYSTEM + [1] * BLOCK) == []
    assert await second.candidates("key-a", SYSTEM + [1] * BLOCK) == ["mine"]


async def test_reindexing_drops_the_blocks_a_conversation_no_longer_has_and_remove_leaves_no_trace(redis_db):
    first, second, client = two_workers(redis_db.url)
    await first.add("key-a", "s", SYSTEM + [5] * BLOCK + [6] * BLOCK)
    await second.add("key-a", "s", SYSTEM + [5] * BLOCK)  # rolled back by a crop, on another worker
    assert await first.candidates("key-a", SYSTEM + [5] * BLOCK + [6] * BLOCK) == ["s"]
    dropped = block_hashes("key-a", SYSTEM + [5] * BLOCK + [6] * BLOCK)[-1]
    assert not await client.exists(prefix_block_key(dropped))
    await first.remove("s")
    assert await second.candidates("key-a", SYSTEM) == [] and await client.dbsize() == 0


async def test_a_session_gone_from_blocks_others_renew_is_removed_when_met(redis_db):
    first, _, client = two_workers(redis_db.url)
    await first.add("key-a", "gone", SYSTEM + [1] * BLOCK)
    await first.add("key-a", "kept", SYSTEM + [2] * BLOCK)
    await client.delete("chatd:{gone}:prefix")  # its own chain expired; the system prompt's blocks did not
    await first.remove("gone", "key-a", SYSTEM + [1] * BLOCK)
    assert await first.candidates("key-a", SYSTEM + [9] * BLOCK) == ["kept"]


async def test_keys_expire_with_the_sessions_and_carry_one_hash_tag_each(redis_db):
    first, _, client = two_workers(redis_db.url)
    await first.add("key-a", "s", SYSTEM + [1] * BLOCK)
    keys = sorted(key.decode() for key in await client.keys("*"))
    assert len(keys) == 4 + 1  # a set per block, and the session's chain
    for key in keys:
        assert key.count("{") == 1 and key.count("}") == 1, key  # one slot per key, whatever the cluster
        assert 0 < await client.ttl(key) <= RETENTION_S


async def test_a_system_prompt_shared_by_many_sessions_yields_a_bounded_list(redis_db):
    first, second, _ = two_workers(redis_db.url)
    for number in range(200):
        await first.add("key-a", f"s{number}", SYSTEM + [number + 1] * BLOCK)
    found = await second.candidates("key-a", SYSTEM + [7] * BLOCK)
    assert found[0] == "s6" and len(found) == MAX_CANDIDATES


async def test_without_redis_each_worker_answers_from_its_own_index(redis_server):
    first, second, _ = two_workers(redis_server.url)
    await first.add("key-a", "before", SYSTEM + [1] * BLOCK)
    redis_server.stop()
    await first.add("key-a", "during", SYSTEM + [2] * BLOCK)  # not in Redis, but in this worker's memory
    assert (await first.candidates("key-a", SYSTEM + [2] * BLOCK))[0] == "during"
    assert await second.candidates("key-a", SYSTEM + [1] * BLOCK) == []  # it never saw either
    assert first.errors >= 1 and second.errors >= 1
