"""The Redis session store against a real redis-server started by the test."""

import asyncio

import pytest
import redis.asyncio as redis

from sessions import Message, SessionBusy, StoreUnavailable, VersionConflict
from sessions.encoding import pack_ids, unpack_ids
from sessions.redis_store import RedisSessionStore


async def test_round_trip_through_a_second_store(redis_db):
    writer = RedisSessionStore(redis_db.url, retention_s=3600)
    session = await writer.create("Be brief.", owner="key-0123456789abcdef")
    await writer.append_turn(session, "hi", "hello!", [1, 2, 3])
    await writer.append_turn(session, "bye", "goodbye", [1, 2, 3, 4, 5], dropped_turns=1, reply_ids=[4, 5])
    branch = await writer.create("Be brief.", owner="key-0123456789abcdef", messages=session.messages[:2])
    reader = RedisSessionStore(redis_db.url, retention_s=3600)
    loaded = await reader.get(session.session_id)
    assert loaded.messages == [Message("user", "hi"), Message("assistant", "hello!"),
                               Message("user", "bye"), Message("assistant", "goodbye")]
    assert [m.token_ids for m in loaded.messages] == [None, None, None, (4, 5)]  # a reply's generated ids
    assert (await reader.get(branch.session_id)).messages == loaded.messages[:2]  # a session created with history
    assert (loaded.system, loaded.token_ids, loaded.version, loaded.turns) == ("Be brief.", [1, 2, 3, 4, 5], 2, 2)
    assert (loaded.owner, loaded.dropped_turns) == ("key-0123456789abcdef", 1)
    assert loaded.created_at == pytest.approx(session.created_at) and loaded.updated_at >= loaded.created_at
    assert await reader.get("no-such-session") is None
    for store in (writer, reader):
        await store.close()


async def test_keys_share_a_hash_tag_are_compact_and_expire(redis_db):
    store = RedisSessionStore(redis_db.url, retention_s=100)
    session = await store.create(None)
    await store.append_turn(session, "a", "b", list(range(1000)))
    client = redis.Redis.from_url(redis_db.url)
    keys = sorted(k.decode() for k in await client.keys("chatd:*"))
    assert keys == [f"chatd:{{{session.session_id}}}:{part}" for part in ("messages", "meta", "tokens")]
    assert await client.strlen(f"chatd:{{{session.session_id}}}:tokens") == 4000, "4 bytes a token id"
    assert all(0 < ttl <= 100 for ttl in [await client.ttl(key) for key in keys])
    assert unpack_ids(pack_ids([0, 1, 49151, 2**31 - 1])) == [0, 1, 49151, 2**31 - 1]
    await client.aclose()
    await store.close()


async def test_retention_ttl_forgets_idle_sessions(redis_db):
    store = RedisSessionStore(redis_db.url, retention_s=1)
    session = await store.create(None)
    await store.append_turn(session, "a", "b", [1])
    await asyncio.sleep(2.2)
    other = RedisSessionStore(redis_db.url, retention_s=1)
    assert await other.get(session.session_id) is None
    await store.close()
    await other.close()


async def test_two_writers_of_one_version_conflict(redis_db):
    first, second = (RedisSessionStore(redis_db.url, retention_s=3600) for _ in range(2))
    created = await first.create(None)
    mine, theirs = await first.get(created.session_id), await second.get(created.session_id)
    await first.append_turn(mine, "from worker 1", "ok 1", [1])
    with pytest.raises(VersionConflict):
        await second.append_turn(theirs, "from worker 2", "ok 2", [2])
    assert theirs.version == 0 and theirs.turns == 0, "a refused turn is not recorded locally either"
    stored = await RedisSessionStore(redis_db.url, retention_s=3600).get(created.session_id)
    assert (stored.version, stored.messages[0].content) == (1, "from worker 1")
    fresh = await second.get(created.session_id)
    await second.append_turn(fresh, "retry", "ok", [3])
    assert fresh.version == 2
    await first.close()
    await second.close()


async def test_an_outage_queues_writes_and_flushes_them_in_order(redis_server):
    store = RedisSessionStore(redis_server.url, retention_s=3600, timeout_s=0.3)
    session = await store.create("sys")
    await store.append_turn(session, "turn 1", "reply 1", [1])
    redis_server.stop()
    assert (await store.get(session.session_id)) is session, "a session on this worker keeps working"
    await store.append_turn(session, "turn 2", "reply 2", [1, 2])
    await store.append_turn(session, "turn 3", "reply 3", [1, 2, 3])
    assert store.pending_writes == 2 and store.errors >= 1
    with pytest.raises(StoreUnavailable):
        await store.create(None)
    with pytest.raises(StoreUnavailable):
        await store.get("a-session-this-worker-never-saw")
    redis_server.start()
    for _ in range(100):
        if store.pending_writes == 0:
            break
        await asyncio.sleep(0.1)
    assert store.pending_writes == 0
    stored = await RedisSessionStore(redis_server.url, retention_s=3600).get(session.session_id)
    assert [m.content for m in stored.messages if m.role == "user"] == ["turn 1", "turn 2", "turn 3"]
    assert (stored.version, stored.token_ids) == (3, [1, 2, 3])
    await store.close()


async def test_a_lease_excludes_other_workers_and_a_lost_lease_cannot_write(redis_db):
    first, second = (RedisSessionStore(redis_db.url, retention_s=3600) for _ in range(2))
    session = await first.create(None)
    held = await first.lease(session.session_id)
    with pytest.raises(SessionBusy):
        await second.lease(session.session_id)
    # The holder stalls past its lease (simulated by the key expiring); another worker takes over.
    client = redis.Redis.from_url(redis_db.url)
    await client.delete(f"chatd:{{{session.session_id}}}:lease")
    newer = await second.lease(session.session_id)
    assert newer.fence > held.fence
    mine = await first.get(session.session_id)
    with pytest.raises(VersionConflict, match="lease"):
        await first.append_turn(mine, "late", "write", [1], held)
    theirs = await second.get(session.session_id)
    await second.append_turn(theirs, "current", "write", [1], newer)
    await newer.release()
    await held.release()  # releasing a lease that is no longer ours leaves the new holder's alone
    assert (await second.get(session.session_id)).version == 1
    await client.aclose()
    for store in (first, second):
        await store.close()


async def test_a_lease_is_waited_for_briefly(redis_db):
    first, second = (RedisSessionStore(redis_db.url, retention_s=3600) for _ in range(2))
    session = await first.create(None)
    held = await first.lease(session.session_id)
    asyncio.get_running_loop().call_later(0.3, lambda: asyncio.ensure_future(held.release()))
    taken = await second.lease(session.session_id)
    assert taken.fence == held.fence + 1
    await taken.release()
    for store in (first, second):
        await store.close()


async def test_a_history_of_ten_thousand_messages_round_trips(redis_db):
    """A long branched history is written whole (Lua's `unpack` takes about 8,000 values at most: messages go a
    batch at a time) and read back equal, and a turn on top of it is recorded."""
    history = [Message("user" if number % 2 == 0 else "assistant", f"message {number}") for number in range(10_000)]
    writer = RedisSessionStore(redis_db.url, retention_s=3600)
    session = await writer.create("Be brief.", messages=history)
    await writer.append_turn(session, "one more", "done", list(range(20_000)))
    reader = RedisSessionStore(redis_db.url, retention_s=3600)
    loaded = await reader.get(session.session_id)
    assert loaded.messages == [*history, Message("user", "one more"), Message("assistant", "done")]
    assert (loaded.version, len(loaded.token_ids)) == (1, 20_000)
    for store in (writer, reader):
        await store.close()


async def test_a_queued_turn_that_conflicts_drops_the_local_copy(redis_server):
    """A turn queued through an outage that another writer overtook is not stored, and this worker reads the
    session again from Redis rather than serving a history Redis does not hold."""
    store, other = (RedisSessionStore(redis_server.url, retention_s=3600, timeout_s=0.3) for _ in range(2))
    session = await store.create("sys")
    theirs = await other.get(session.session_id)
    await other.append_turn(theirs, "from another worker", "theirs", [9])  # (this worker does not know yet)
    redis_server.stop()
    await store.append_turn(session, "queued 1", "reply 1", [1])
    await store.append_turn(session, "queued 2", "reply 2", [1, 2])
    assert store.pending_writes == 2 and (await store.get(session.session_id)).version == 2
    redis_server.start()
    for _ in range(100):
        if store.pending_writes == 0:
            break
        await asyncio.sleep(0.1)
    assert store.pending_writes == 0 and store.conflicts == 1
    read = await store.get(session.session_id)
    assert [m.content for m in read.messages] == ["from another worker", "theirs"] and read.version == 1
    for each in (store, other):
        await each.close()


async def test_a_recorded_turn_lets_its_lease_go_in_the_same_round_trip(redis_db):
    """The turn's write lets its lease go (one round trip fewer per turn with Redis far away): the next worker takes
    the session at once, and the holder's own release then asks Redis nothing. A write refused for a lost lease
    leaves the newer holder's lease alone."""
    first, second = (RedisSessionStore(redis_db.url, retention_s=3600) for _ in range(2))
    client = redis.Redis.from_url(redis_db.url)
    session = await first.create(None)
    held = await first.lease(session.session_id)
    await first.append_turn(await first.get(session.session_id), "hi", "hello", [1, 2], held)
    assert not await client.exists(f"chatd:{{{session.session_id}}}:lease")
    scripts_before = (await client.info("commandstats")).get("cmdstat_eval", {}).get("calls", 0)
    await held.release()
    assert (await client.info("commandstats")).get("cmdstat_eval", {}).get("calls", 0) == scripts_before
    taken = await second.lease(session.session_id)
    with pytest.raises(VersionConflict):  # (the first holder's lease, let go, written with again)
        await first.append_turn(await first.get(session.session_id), "late", "write", [1], held)
    assert await client.get(f"chatd:{{{session.session_id}}}:lease") is not None, "the new holder's lease stays"
    await taken.release()
    await client.aclose()
    for store in (first, second):
        await store.close()
