"""Turns acknowledged once a replica holds them (Redis `WAIT`), on a real Redis with a real replica: the replica
holds every acknowledged turn, a replica that is gone makes turns slower but not failed (counted), and a turn that
Redis cannot record is answered `unavailable` and leaves nothing behind."""

import asyncio
import json
import re
import urllib.request

import pytest
import redis

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError, connect
from chatd.config import Settings


async def _get(server: ChatServer, path: str) -> str:
    return (await asyncio.to_thread(urllib.request.urlopen, f"http://127.0.0.1:{server.port}{path}")).read().decode()


def _waits(metrics: str, outcome: str) -> float:
    found = re.search(rf'chatd:redis_wait_seconds_count\{{model_name="[^"]+",outcome="{outcome}"\}} (\S+)', metrics)
    return float(found.group(1))


async def test_a_turn_is_answered_once_the_replica_holds_it(tiny, redis_with_replica):
    """Where each primary has a replica, a worker waits for one by itself: when a turn is answered, the replica
    already holds it. With the replica gone, turns are still answered (within the WAIT timeout), counted short."""
    primary, replica = redis_with_replica
    settings = Settings(port=0, redis_url=primary.url, redis_wait_timeout_ms=2000)  # (a busy machine's replica)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        assert settings.redis_wait_replicas == 1
        on_replica = redis.Redis(port=replica.port)
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session(system="Be brief.")).session_id
            for number, question in enumerate(["Hello.", "My order is late.", "Thanks."]):
                turn = await client.chat(session_id, question, max_new_tokens=5)
                await turn.result()
                assert on_replica.llen(f"chatd:{{{session_id}}}:messages") == 2 * (number + 1)
            metrics = await _get(server, "/metrics")
            assert _waits(metrics, "acked") == 4 and _waits(metrics, "short") == 0  # the session, three turns
            stats = json.loads(await _get(server, "/v1/stats"))["now"]["redis"]
            assert stats["wait_replicas"] == 1 and stats["waits"] == {"acked": 4}

            replica.stop()
            turn = await client.chat(session_id, "Are you there?", max_new_tokens=5)
            await turn.result()
            assert redis.Redis(port=primary.port).llen(f"chatd:{{{session_id}}}:messages") == 8
            assert _waits(await _get(server, "/metrics"), "short") == 1


async def test_a_turn_redis_cannot_record_is_unavailable_and_leaves_nothing(tiny, redis_with_replica):
    """The primary dies while a reply streams: the worker retries the turn's write for `--redis-failover-s`, then
    answers `unavailable` (retryable) and keeps nothing of it; sent again once Redis is back, the message gets the
    reply a fresh conversation gets, and the history holds it once."""
    primary, _ = redis_with_replica
    settings = Settings(port=0, redis_url=primary.url, redis_failover_s=1.0)
    async with ChatServer(settings, load=lambda: tiny) as server, \
            ChatServer(Settings(port=0, session_cache=False), load=lambda: tiny) as reference_server:
        for each in (server, reference_server):
            await each.wait_ready()
        async with ChatClient(await connect(server.url)) as client, \
                ChatClient(await connect(reference_server.url)) as reference:
            session_id = (await client.open_session(system="Be brief.")).session_id
            turn = await client.chat(session_id, "My order is late.", max_new_tokens=40)
            async for _ in turn:
                primary.process.kill()  # SIGKILL: the turn's write finds no Redis
                break
            with pytest.raises(ChatError) as failed:
                await turn.result()
            assert failed.value.code == "unavailable" and failed.value.retryable
            primary.process.wait(10)
            primary.start()  # (its append-only file has what was acknowledged)
            primary.wait_replicated()
            again = await client.chat(session_id, "My order is late.", max_new_tokens=8)
            await again.result()
            expected_id = (await reference.open_session(system="Be brief.")).session_id
            expected = await reference.chat(expected_id, "My order is late.", max_new_tokens=8)
            await expected.result()
            assert again.deltas == expected.deltas
            assert redis.Redis(port=primary.port).llen(f"chatd:{{{session_id}}}:messages") == 2
            assert server.sessions.state()["retries"] > 0


async def test_waiting_for_more_replicas_than_redis_has_is_said_at_start_and_turns_still_answer(tiny, redis_db,
                                                                                                caplog):
    settings = Settings(port=0, redis_url=redis_db.url, redis_wait_replicas=1, redis_wait_timeout_ms=100)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        assert "--redis-wait-replicas is 1 but a Redis primary has 0 replica(s)" in caplog.text
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session()).session_id
            await (await client.chat(session_id, "Hello.", max_new_tokens=4)).result()
        assert server.sessions.state()["waits"] == {"short": 2}  # the session and its turn, each after 100 ms
