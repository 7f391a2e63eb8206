"""The remote KV tier in a real redis-server: a cache written by one worker is restored by another
and passes every check; damaged blobs are caught and recomputed; the cost model decides."""

import asyncio
import json
import re
import threading
import time
import urllib.request

import pytest
import redis.asyncio as redis
import torch
from redis import Redis
from transformers import DynamicCache
from websockets.asyncio.client import connect

from cache_store import CacheEntry, CacheLayout, Offloader
from cache_store.checks.integrity import fingerprint
from cache_store.remote.chunks import chunk_identity, chunk_names
from cache_store.remote.cost_model import CostModel, Throughput
from cache_store.remote.remote_format import RemoteSnapshot, chunk_key
from cache_store.remote.remote_tier import RemoteTier
from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.engine.turn import TurnResult
from sessions import Session
from sessions.redis_store import RedisSessionStore
from tests.redis_server import RedisServer
from tests.support import kv_budget_mb, run_turn, running_engine, two_workers_and_a_reference

QUESTIONS = ["My parcel is late.", "It was sent on Monday.", "Where is it now?"]


async def wait_for_remote(url: str, session_id: str, version: int) -> None:
    client = redis.Redis.from_url(url)
    for _ in range(200):
        raw = await client.get(f"chatd:{{{session_id}}}:kvmeta")
        if raw and json.loads(raw)["session_version"] >= version:
            break
        await asyncio.sleep(0.02)
    else:
        raise AssertionError("the remote cache was never written")
    await client.aclose()


async def conversation(tiny, redis_db, damage=None):
    """Two turns on worker A, optional damage to the remote copy, the third turn on worker B."""
    settings = Settings(port=0, redis_url=redis_db.url, remote_kv=True, remote_kv_fetch="always")
    async with two_workers_and_a_reference(tiny, settings) as (on_a, on_b, reference, servers):
        session_id = (await on_a.open_session(system="Be brief.")).session_id
        reference_id = (await reference.open_session(system="Be brief.")).session_id
        other_id = (await on_a.open_session(system="Another customer.")).session_id
        for question in ("Hello there", "Me again"):  # as many turns as the session: the same version
            await (await on_a.chat(other_id, question, max_new_tokens=5)).result()
        for question in QUESTIONS[:2]:
            await (await on_a.chat(session_id, question, max_new_tokens=6)).result()
            await (await reference.chat(reference_id, question, max_new_tokens=6)).result()
        await wait_for_remote(redis_db.url, session_id, 2)
        await wait_for_remote(redis_db.url, other_id, 2)
        if damage:
            client = redis.Redis.from_url(redis_db.url)
            await damage(client, session_id, other_id)
            await client.aclose()
        turn = await on_b.chat(session_id, QUESTIONS[2], max_new_tokens=6)
        done = await turn.result()
        expected = await reference.chat(reference_id, QUESTIONS[2], max_new_tokens=6)
        await expected.result()
        assert turn.deltas == expected.deltas
        return done


async def test_a_cache_written_by_one_worker_is_restored_by_another(tiny, redis_db):
    done = await conversation(tiny, redis_db)
    assert done.cache.source == "remote" and done.usage.cached_tokens > 0
    assert done.cache.remote.choice == "fetch"
    assert done.cache.remote.fetch_ms is not None and done.cache.remote.prefill_ms is not None


async def truncate(client, session_id, _):
    key = f"chatd:{{{session_id}}}:kv"
    await client.set(key, (await client.get(key))[:-100])


async def swap_in_other(client, session_id, other_id):
    for part in ("kv", "kvmeta"):
        await client.set(f"chatd:{{{session_id}}}:{part}", await client.get(f"chatd:{{{other_id}}}:{part}"))


async def flip_a_byte(client, session_id, _):
    key = f"chatd:{{{session_id}}}:kv"
    blob = bytearray(await client.get(key))
    blob[len(blob) // 2] ^= 0x01
    await client.set(key, bytes(blob))


@pytest.mark.parametrize(("damage", "check", "source"), [
    (truncate, "length", "remote"), (flip_a_byte, "checksum", "remote"), (swap_in_other, "fingerprint", "miss")])
async def test_a_damaged_remote_cache_is_caught_and_recomputed(tiny, redis_db, damage, check, source):
    """A damaged tail (in the session's own key) is caught, and the cache restored up to its last whole chunk; a
    copy of another session's is refused whole."""
    done = await conversation(tiny, redis_db, damage)
    assert (done.cache.source, done.cache.cleared) == (source, [check])
    if source == "remote":
        assert 0 < done.usage.cached_tokens and done.usage.cached_tokens % 32 == 0, "its whole chunks"
    else:
        assert done.cache.miss_reason == "corrupt"


async def test_a_header_whose_bytes_are_gone_is_a_miss_and_is_deleted(tiny, redis_db):
    async def lose_bytes(client, session_id, _):
        await client.delete(f"chatd:{{{session_id}}}:kv")

    done = await conversation(tiny, redis_db, lose_bytes)
    assert (done.cache.source, done.cache.miss_reason) == ("miss", "cold")


def test_the_cost_model_picks_the_faster_path():
    throughput = Throughput()
    model = CostModel(throughput)
    assert model.decide(10**8, 2048).choice == "fetch", "nothing measured yet: fetch and measure"
    throughput.record(10**9, 1.0)  # 1 GB/s
    model.record_prefill(2048, 4.0)  # 512 tokens/s, a CPU
    cpu = model.decide(94_000_000, 2048)
    assert (cpu.choice, round(cpu.fetch_ms), round(cpu.prefill_ms)) == ("fetch", 94, 4000)
    model.prefill_tokens_per_s = 200_000.0  # a GPU with a small model
    assert model.decide(94_000_000, 2048).choice == "recompute"
    model.record_prefill(1, 0.001)
    assert model.prefill_tokens_per_s == 200_000.0, "decode steps do not count as prefill"


async def test_turns_go_on_without_stalling_while_the_remote_tier_is_down(tiny, redis_server):
    settings = Settings(port=0, redis_url=redis_server.url, remote_kv=True, remote_kv_fetch="always")
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session()).session_id
            await (await client.chat(session_id, "hello", max_new_tokens=3)).result()
            redis_server.stop()
            server.engine.drop_cache(session_id)  # only Redis could help now
            done = await (await client.chat(session_id, "still there?", max_new_tokens=3)).result()
            assert done.cache.source == "miss" and done.usage.completion_tokens == 3
            assert server.engine.cache.remote.errors >= 1
            redis_server.start()


def test_after_a_failure_the_remote_tier_is_skipped_instead_of_waited_on():
    from chatd.cli.server_process import free_port

    remote = RemoteTier(f"redis://127.0.0.1:{free_port()}/0", ttl_s=60)  # nothing listens there
    assert remote.head("s") is None and remote.errors == 1
    assert remote.head("s") is None and remote.errors == 1, "the second lookup did not try Redis"
    remote.close()


def snapshot(tokens: int) -> RemoteSnapshot:
    """A small cache's snapshot, as the store hands the remote writer."""
    cache = DynamicCache()
    for layer in range(2):
        keys = torch.randn(1, 2, tokens, 8)
        cache.update(keys, keys + 1, layer)
    entry = CacheEntry(cache, list(range(tokens)))
    layout = CacheLayout(2, 2, 8, torch.float32)
    entry.fingerprint = fingerprint(entry, "model", "owner", layout)
    chunks = chunk_names(entry.token_ids, chunk_identity("model", "owner:*", layout, "exact"))
    tensors, scales = Offloader(torch.device("cpu")).snapshot(entry, 0)
    return RemoteSnapshot(entry.token_ids, entry.fingerprint, 0, "exact", chunks, 0, tensors, scales)


async def test_the_remote_writer_goes_on_after_redis_refuses_a_write(redis_server):
    """A `maxmemory` refusal (an OOM ResponseError, not a connection error) fails that snapshot only."""
    tier = RemoteTier(redis_server.url, ttl_s=60)
    admin = redis.Redis.from_url(redis_server.url)
    try:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", 1)  # below what Redis already uses: every write is refused
        tier.put("refused", snapshot(64))
        for _ in range(200):
            if tier.write_errors:
                break
            await asyncio.sleep(0.02)
        assert tier.write_errors == 1
        await admin.config_set("maxmemory", 0)
        for name in ("later", "and-later"):
            tier.put(name, snapshot(64))
        for _ in range(200):
            if tier.head("and-later") is not None:
                break
            await asyncio.sleep(0.02)
        assert tier.head("later") is not None and tier.head("and-later") is not None, "later snapshots arrive"
        assert tier.head("refused") is None and tier.write_errors == 1
    finally:
        tier.close()
        await admin.aclose()


POLICY = ("You are the support agent of Northwind Internet. Refunds take 14 days. Never promise a date. Ask for "
          "the order number first.")


CHUNKED = {"remote_kv_chunk_tokens": 16}  # short chunks, so that the tiny model's short conversations have some


async def policy_conversation(tiny, redis_db, damage=None):
    """Two turns of a session on worker A, another session with the same policy on worker B (which then holds
    the policy's segment), optional damage, and the session's third turn on worker B."""
    settings = Settings(port=0, redis_url=redis_db.url, remote_kv=True,
                        remote_kv_fetch="always", shared_prompt_min_tokens=16, **CHUNKED)
    async with two_workers_and_a_reference(tiny, settings) as (on_a, on_b, reference, servers):
        session_id = (await on_a.open_session(system=POLICY)).session_id
        reference_id = (await reference.open_session(system=POLICY)).session_id
        neighbour = (await on_b.open_session(system=POLICY)).session_id
        await (await on_b.chat(neighbour, "Hello there", max_new_tokens=5)).result()
        for question in QUESTIONS[:2]:
            await (await on_a.chat(session_id, question, max_new_tokens=6)).result()
            await (await reference.chat(reference_id, question, max_new_tokens=6)).result()
        await wait_for_remote(redis_db.url, session_id, 2)
        worker_b = servers[1].engine
        if damage:
            await damage(redis_db.url, session_id, worker_b)
        turn = await on_b.chat(session_id, QUESTIONS[2], max_new_tokens=6)
        done = await turn.result()
        expected = await reference.chat(reference_id, QUESTIONS[2], max_new_tokens=6)
        await expected.result()
        assert turn.deltas == expected.deltas
        chained = await asyncio.wrap_future(worker_b.call(
            lambda store: (entry := store.device.get(session_id)) is not None and entry.prefix_tokens > 0))
        return done, chained, worker_b.cache.counters


async def test_a_remote_cache_restored_where_its_policy_is_resident_starts_with_it(tiny, redis_db):
    done, chained, counters = await policy_conversation(tiny, redis_db)
    assert done.cache.source == "remote" and chained, "only the chunks after worker B's own policy fetched"
    assert counters["remote_bytes_not_fetched"] > 0
    assert not [name for name in counters if name.startswith("corrupt_")]


async def flip_a_byte_of_its_last_chunk(url, session_id, _):
    """A byte of the keys of the session's last whole chunk (after the policy, which the receiving worker holds)."""
    client = redis.Redis.from_url(url)
    name = json.loads(await client.get(f"chatd:{{{session_id}}}:kvmeta"))["chunks"][-1]
    blob = bytearray(await client.get(chunk_key(name)))
    blob[-100] ^= 0x01
    await client.set(chunk_key(name), bytes(blob))
    await client.aclose()


async def corrupt_the_resident_policy(_, __, engine):
    from cache_store.device.segments import is_segment
    from cache_store.faults import corrupt
    await asyncio.wrap_future(engine.call(
        lambda store: [corrupt(store, key, "bitflip", "device") for key in store.device if is_segment(key)]))


@pytest.mark.parametrize("damage", [flip_a_byte_of_its_last_chunk, corrupt_the_resident_policy])
async def test_a_damaged_chunk_in_redis_or_policy_on_the_receiving_worker_is_caught_and_the_reply_is_right(
        tiny, redis_db, damage):
    done, _, counters = await policy_conversation(tiny, redis_db, damage)
    assert done.cache.source == "remote" and counters["corrupt_checksum"] == 1


async def flip_a_byte_of_a_shared_chunk(client: redis.Redis, key: str) -> bytes:
    blob = bytearray(await client.get(key))
    blob[-8] ^= 0x01
    await client.set(key, bytes(blob))
    return bytes(blob)


@pytest.mark.parametrize("damaged", [False, True])
async def test_sessions_sharing_a_policy_store_its_chunks_once_and_another_worker_fetches_them_once(
        tiny, redis_db, damaged):
    """Three conversations with one policy on worker A: their chains in Redis start with the same chunks, stored
    once; worker B, which has never seen the policy, fetches them once (then holds the policy as a segment) and
    continues all three exactly. A corrupted policy chunk in Redis is caught at its first fetch and deleted: every
    conversation still answers right, and the next write heals Redis."""
    settings = Settings(port=0, redis_url=redis_db.url, remote_kv=True,
                        remote_kv_fetch="always", shared_prompt_min_tokens=16, **CHUNKED)
    async with two_workers_and_a_reference(tiny, settings) as (on_a, on_b, reference, servers):
        pairs = []
        for question in QUESTIONS:
            session_id = (await on_a.open_session(system=POLICY)).session_id
            reference_id = (await reference.open_session(system=POLICY)).session_id
            await (await on_a.chat(session_id, question, max_new_tokens=6)).result()
            await (await reference.chat(reference_id, question, max_new_tokens=6)).result()
            await wait_for_remote(redis_db.url, session_id, 1)
            pairs.append((session_id, reference_id))
        client = redis.Redis.from_url(redis_db.url)
        chains = [json.loads(await client.get(f"chatd:{{{session_id}}}:kvmeta"))["chunks"] for session_id, _ in pairs]
        policy_chunks = [name for name in chains[0] if all(name in chain for chain in chains)]
        assert policy_chunks and policy_chunks == chains[0][:len(policy_chunks)]
        held = {key.decode() async for key in client.scan_iter("chatd:kvchunk:*")}
        assert held == {chunk_key(name) for chain in chains for name in chain}, "each chunk once"
        shared = chunk_key(policy_chunks[0])
        damage = await flip_a_byte_of_a_shared_chunk(client, shared) if damaged else None
        worker_b = servers[1].engine
        sources = []
        for session_id, reference_id in pairs:
            turn = await on_b.chat(session_id, "And then?", max_new_tokens=6)
            done = await turn.result()
            expected = await reference.chat(reference_id, "And then?", max_new_tokens=6)
            await expected.result()
            assert turn.deltas == expected.deltas
            sources.append((done.cache.source, done.cache.miss_reason))
        counters = worker_b.cache.counters
        if damaged:
            assert sources[0] == ("miss", "corrupt") and counters["corrupt_checksum"] == 1
            # Deleted, then written again by worker B from the policy it recomputed: Redis is healed.
            await wait_for_remote(redis_db.url, pairs[0][0], 2)
            assert await client.get(shared) not in (None, damage)
        else:
            assert sources == [("remote", None)] * len(pairs) and counters["remote_policies_held"] == 1
            assert counters["remote_bytes_not_fetched"] > 0, "the policy's chunks fetched once"
            writer = servers[0].engine.cache.stats()
            assert writer["remote_chunks_renewed"] > 0 and writer["remote_snapshot_kv_bytes_skipped"] > 0
            metrics = await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{servers[1].port}/metrics")
            assert re.search(r'chatd:kv_remote_chunk_bytes_total\{kind="not_fetched",model_name="[^"]+"\} [1-9]',
                             metrics.read().decode())
        await client.aclose()


async def test_two_keys_with_the_same_policy_never_share_its_chunks_in_redis(tiny, redis_db):
    """Chunks are named for their owner: the same policy under two API keys is two chains."""
    settings = Settings(port=0, redis_url=redis_db.url, remote_kv=True,
                        remote_kv_fetch="always", shared_prompt_min_tokens=16,
                        api_key=["key-a", "key-b"], **CHUNKED)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        chains = {}
        for key in ("key-a", "key-b"):
            async with await ChatClient.connect(server.url, api_key=key) as client:
                session_id = (await client.open_session(system=POLICY)).session_id
                await (await client.chat(session_id, QUESTIONS[0], max_new_tokens=4)).result()
            await wait_for_remote(redis_db.url, session_id, 1)
            client = redis.Redis.from_url(redis_db.url)
            chains[key] = json.loads(await client.get(f"chatd:{{{session_id}}}:kvmeta"))["chunks"]
            await client.aclose()
        assert chains["key-a"] and chains["key-b"] and not set(chains["key-a"]) & set(chains["key-b"])


async def test_a_conversation_alternating_workers_fetches_only_the_chunks_each_lacks(tiny, redis_db):
    """Turn by turn on worker A, then B, then A...: each turn continues the copy its worker holds from two turns
    before with only the chunks after it, and answers as a server with no cache at all."""
    settings = Settings(port=0, redis_url=redis_db.url, remote_kv=True, remote_kv_fetch="always", **CHUNKED)
    async with two_workers_and_a_reference(tiny, settings) as (on_a, on_b, reference, servers):
        session_id = (await on_a.open_session(system="Be brief.")).session_id
        reference_id = (await reference.open_session(system="Be brief.")).session_id
        questions = [*QUESTIONS, "Can you check again?", "Thanks.", "One more thing."]
        for turn_number, question in enumerate(questions):
            client = (on_a, on_b)[turn_number % 2]
            turn = await client.chat(session_id, question, max_new_tokens=6)
            done = await turn.result()
            expected = await reference.chat(reference_id, question, max_new_tokens=6)
            await expected.result()
            assert turn.deltas == expected.deltas
            if turn_number:
                assert done.cache.source == "remote" and done.usage.cached_tokens > 0
            await wait_for_remote(redis_db.url, session_id, turn_number + 1)
        for server in servers[:2]:
            counters = server.engine.cache.counters
            assert counters["remote_bytes_not_fetched"] > 0, "later fetches skipped the chunks the worker held"


def test_queued_writes_are_bounded_in_bytes_and_age_and_what_is_dropped_is_counted():
    """While Redis answers nothing (a listener that never replies), snapshots queue within their byte budget (the
    oldest dropped for a newer one), a delete cancels the session's queued snapshot, and a snapshot queued longer
    than its age limit is dropped unwritten; whoever waits for one is told at once."""
    import socket

    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # connections complete in the kernel; nothing is ever read or answered
    size = snapshot(64).nbytes
    tier = RemoteTier(f"redis://127.0.0.1:{silent.getsockname()[1]}/0", ttl_s=60, timeout_s=0.5,
                      pending_bytes=int(2.5 * size), pending_age_s=0.3)
    try:
        tier.put("first", snapshot(64))  # the writer takes it and waits out the timeout
        for _ in range(100):
            if tier.pending()["pending_writes"] == 0:
                break
            time.sleep(0.01)
        for name in ("a", "b", "c"):
            tier.put(name, snapshot(64))
        assert tier.wait_written("a", 0), "dropped for a newer snapshot: nobody waits for it"
        tier.delete("b", snapshot(64).session_version)
        assert tier.pending() == {"pending_writes": 1, "pending_bytes": size, "pending_deletes": 1,
                                  "dropped_full": 1, "dropped_expired": 0, "dropped_deletes": 0}
        assert tier.wait_written("c", 5) and tier.drain(5)
        assert tier.pending()["dropped_expired"] == 1 and tier.write_errors == 2  # "first", then the delete
    finally:
        tier.close()
        silent.close()


POLICY = ("You are the support desk of a parcel company. Answer in one short sentence, politely, and never promise "
          "a delivery date. Refunds take five working days; a lost parcel is refunded in full once the carrier "
          "confirms it.")  # (long enough to be held as a shared segment)


def test_a_fetch_that_meets_a_full_arena_waits_for_room_and_keeps_the_copy_in_redis(tiny, redis_db):
    """Worker B has no copy of a session that worker A served (Redis has one), its system prompt's segment went to
    B's host tier, and one long decoding turn fills B's arena: bringing the segment back for the fetch finds no
    room. The turn waits for the long one to end (never `internal`, never deleting the copy), then continues from
    Redis, and its reply equals a no-cache engine's. (B's device budget is set above its arena, so that admission
    lets the turn in while the arena is full: the way any turn meets a full arena after its admission.)"""
    shared = dict(redis_url=redis_db.url, remote_kv=True, remote_kv_fetch="always", max_batch=4,
                  verify_sample_rate=0)
    with running_engine(tiny, **shared) as worker_a, \
            running_engine(tiny, device_cache_mb=kv_budget_mb(tiny, 256), **shared) as worker_b, \
            running_engine(tiny, session_cache=False) as uncached:
        worker_b.call(lambda store: setattr(store.device, "budget_bytes", 2**40)).result()
        session, reference = Session("moved", system=POLICY), Session("moved", system=POLICY)
        for question in QUESTIONS[:2]:
            run_turn(worker_a, session, question, max_new_tokens=4)
            run_turn(uncached, reference, question, max_new_tokens=4)
        assert worker_a.wait_shared(session.session_id, 10)
        run_turn(worker_b, Session("other", system=POLICY), "Hello", max_new_tokens=4)  # B's segment of the policy
        moved: dict[str, object] = {}

        def while_it_decodes(turn, _text):  # (the engine thread: the long turn's region fills the arena now)
            if "thread" not in moved:
                held = worker_b.cache.host.keys()
                moved["segment_on_host"] = any(key.startswith("prefix:") for key in held)
                moved["thread"] = threading.Thread(target=lambda: moved.update(
                    result=run_turn(worker_b, session, QUESTIONS[2], max_new_tokens=4)[0]))
                moved["thread"].start()

        run_turn(worker_b, Session("long", system="Tell a long story."), "Once upon a time", on_text=while_it_decodes,
                 max_new_tokens=200)
        moved["thread"].join(60)
        expected, _ = run_turn(uncached, reference, QUESTIONS[2], max_new_tokens=4)
        assert moved["segment_on_host"], "the long turn sent the policy's segment to the host tier"
        done = moved["result"]
        assert isinstance(done, TurnResult), done
        assert worker_b.failures["lookup"] == 0
        assert done.token_ids == expected.token_ids
        assert done.cache_source == "remote" and done.cached_tokens > 64, "Redis's copy, not the segment alone"


async def test_a_redis_full_of_caches_evicts_caches_and_keeps_every_session(tiny, tmp_path):
    """Redis as compose and the manifests run it: a `maxmemory` with `volatile-ttl`, so that what expires soonest
    goes first (a cache, kept an hour, before a session, kept a week). Filled past its limit by conversations'
    caches, it evicts caches, and every session is still there, with every turn."""
    server = RedisServer(tmp_path, "--maxmemory", "16mb", "--maxmemory-policy", "volatile-ttl")
    server.start()
    try:
        async with ChatServer(Settings(port=0, redis_url=server.url, remote_kv=True, max_sessions_per_connection=64),
                              load=lambda: tiny) as chat:
            await chat.wait_ready()
            async with ChatClient(await connect(chat.url)) as client:
                sessions = []
                for index in range(30):  # each about 450 tokens: 450 KB of keys and values in Redis
                    session_id = (await client.open_session(system=f"Customer {index}.")).session_id
                    long = f"Order {index}: " + " ".join(f"parcel {n} is late;" for n in range(70))
                    await (await client.chat(session_id, long, max_new_tokens=4)).result()
                    assert chat.engine.wait_shared(session_id, 10)
                    sessions.append(session_id)
        assert Redis.from_url(server.url).info("stats")["evicted_keys"] > 0, "Redis was filled past its limit"
        store = RedisSessionStore(server.url, retention_s=60)
        kept = [await store.get(session_id) for session_id in sessions]
        assert all(session is not None and session.version == 1 for session in kept), "every session is kept"
        await store.close()
    finally:
        server.stop()
