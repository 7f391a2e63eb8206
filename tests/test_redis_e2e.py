"""chatd with its sessions in a real redis-server: restarts and outages lose no completed turn."""

import asyncio
import re

import httpx
from redis import Redis
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings
from sessions.redis_store import RedisSessionStore
from tests.support import two_workers_and_a_reference

SYSTEM = "You are a support agent for Northwind Internet. Answer briefly."
QUESTIONS = ["My internet is down.", "The router light is red.", "I restarted it.", "Now it is green, thanks!"]


async def test_a_conversation_survives_a_restart_and_continues_exactly(tiny, redis_db):
    async with ChatServer(Settings(port=0), load=lambda: tiny) as reference:
        await reference.wait_ready()
        async with ChatClient(await connect(reference.url)) as client:
            session_id = (await client.open_session(system=SYSTEM)).session_id
            expected = [await client.chat(session_id, question, max_new_tokens=12) for question in QUESTIONS[:1]]
            await expected[0].result()
            for question in QUESTIONS[1:]:
                expected.append(await client.chat(session_id, question, max_new_tokens=12))
                await expected[-1].result()

    settings = Settings(port=0, redis_url=redis_db.url)
    async with ChatServer(settings, load=lambda: tiny) as first:
        await first.wait_ready()
        async with ChatClient(await connect(first.url)) as client:
            session_id = (await client.open_session(system=SYSTEM)).session_id
            for question in QUESTIONS[:3]:
                await (await client.chat(session_id, question, max_new_tokens=12)).result()

    async with ChatServer(settings, load=lambda: tiny) as second:
        await second.wait_ready()
        async with ChatClient(await connect(second.url)) as client:
            reopened = await client.open_session(session_id=session_id)
            assert (reopened.resumed, reopened.turns) == (True, 3)
            turn = await client.chat(session_id, QUESTIONS[3], max_new_tokens=12)
            done = await turn.result()
            assert (done.cache.source, done.cache.miss_reason) == ("miss", "cold")
            assert turn.deltas == expected[3].deltas, "the whole history was there"
            stored = await second.sessions.get(session_id)
            assert stored.version == 4 and len(stored.token_ids) >= done.usage.prompt_tokens


async def test_chatting_through_a_redis_outage_loses_no_turn(tiny, redis_server):
    """Through an outage the worker stays ready (it serves the sessions it holds and queues their writes; one shared
    Redis blinking must not empty the whole pool), and says where Redis stands in its metrics."""
    async with ChatServer(Settings(port=0, redis_url=redis_server.url), load=lambda: tiny) as server, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session()).session_id
            await (await client.chat(session_id, "turn 1", max_new_tokens=4)).result()
            assert _gauge(await http.get("/metrics"), "chatd:redis_reachable") == 1.0
            redis_server.stop()
            for index in (2, 3):
                done = await (await client.chat(session_id, f"turn {index}", max_new_tokens=4)).result()
                assert done.cache.source == "device"
            assert (await http.get("/readyz")).status_code == 200, "ready through the outage"
            metrics = await http.get("/metrics")
            assert _gauge(metrics, "chatd:redis_reachable") == 0.0 and \
                _gauge(metrics, "chatd:redis_pending_writes") >= 2
            for attempt in ({"session_id": None}, {"session_id": "unknown-to-this-worker"}):
                try:
                    await client.open_session(**attempt)
                    raise AssertionError("opening a session without Redis must fail")
                except ChatError as error:
                    assert (error.code, error.retryable) == ("unavailable", True)
            redis_server.start()
            for _ in range(100):
                if server.sessions.pending_writes == 0:
                    break
                await asyncio.sleep(0.1)
            done = await (await client.chat(session_id, "turn 4", max_new_tokens=4)).result()
            assert done.cache.source == "device"
            assert _gauge(await http.get("/metrics"), "chatd:redis_reachable") == 1.0
    stored = await RedisSessionStore(redis_server.url, retention_s=60).get(session_id)
    assert [m.content for m in stored.messages if m.role == "user"] == ["turn 1", "turn 2", "turn 3", "turn 4"]
    assert stored.version == 4


async def test_two_workers_share_sessions_and_a_stale_cache_is_dropped(tiny, redis_db):
    settings = Settings(port=0, redis_url=redis_db.url)
    async with two_workers_and_a_reference(tiny, settings) as (on_a, on_b, reference, _):
        session_id = (await on_a.open_session(system="Be brief.")).session_id
        reference_id = (await reference.open_session(system="Be brief.")).session_id
        plan = [(on_a, "device or miss"), (on_b, "cold"), (on_a, "stale"), (on_a, "device")]
        for index, (client, expected) in enumerate(plan):
            turn = await client.chat(session_id, f"question {index}", max_new_tokens=6)
            done = await turn.result()
            same = await reference.chat(reference_id, f"question {index}", max_new_tokens=6)
            await same.result()
            assert turn.deltas == same.deltas, f"turn {index + 1}"
            if expected in ("cold", "stale"):
                assert (done.cache.source, done.cache.miss_reason) == ("miss", expected)
            elif expected == "device":
                assert done.cache.source == "device"
        assert (await on_b.open_session(session_id=session_id)).turns == 4

        # Another worker holding the lease makes this one answer busy (after a short wait).
        other_worker = RedisSessionStore(redis_db.url, retention_s=60)
        lease = await other_worker.lease(session_id)
        with_lease_taken = await on_a.chat(session_id, "are you there?", max_new_tokens=2)
        try:
            await with_lease_taken.result()
            raise AssertionError("expected busy")
        except ChatError as error:
            assert (error.code, error.retryable) == ("busy", True)
        await lease.release()
        await other_worker.close()
        assert (await (await on_a.chat(session_id, "now?", max_new_tokens=2)).result()).usage.completion_tokens == 2


async def test_a_turn_costs_redis_two_calls_its_lease_with_the_session_and_its_write(tiny, redis_server):
    """Where Redis is far, each call delays the turn: the session is read in the lease's own script (and only then
    checked to be this key's), and the turn's write lets the lease go, so a websocket turn costs Redis two calls."""
    async with ChatServer(Settings(port=0, redis_url=redis_server.url), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session(system=SYSTEM)).session_id
            await (await client.chat(session_id, QUESTIONS[0], max_new_tokens=4)).result()
            redis = Redis.from_url(redis_server.url)
            redis.config_resetstat()
            done = await (await client.chat(session_id, QUESTIONS[1], max_new_tokens=4)).result()
            calls = redis.info("commandstats")  # (the commands a script runs are counted too, under their names)
            redis.close()
    assert done.cache.source == "device"
    assert calls["cmdstat_eval"]["calls"] == 2 and "cmdstat_evalsha" not in calls, calls


async def test_a_turn_of_a_made_up_session_is_unknown_and_leaves_no_key(tiny, redis_server):
    async with ChatServer(Settings(port=0, redis_url=redis_server.url), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            turn = await client.chat("made-up-session-id", "Hello?", max_new_tokens=4)
            try:
                await turn.result()
                raise AssertionError("a made-up session ran a turn")
            except ChatError as error:
                assert error.code == "unknown_session"
        redis = Redis.from_url(redis_server.url)
        assert redis.keys("*made-up-session-id*") == []
        redis.close()


def _gauge(metrics: httpx.Response, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", metrics.text, re.MULTILINE)
    assert match, name
    return float(match.group(1))


async def test_shutdown_saves_queued_turns_before_the_engine_stops(tiny, redis_server):
    """Turns recorded through an outage are queued; at shutdown they are written before the engine stops (whose stop
    may wait on Redis for the KV caches and on the KV events), so a grace period that runs out costs no turn."""
    order = []
    async with ChatServer(Settings(port=0, redis_url=redis_server.url), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session()).session_id
            redis_server.stop()
            await (await client.chat(session_id, "queued through the outage", max_new_tokens=4)).result()
            assert server.sessions.pending_writes == 1
            redis_server.start()
        flush, stop = server.sessions.flush, server.engine.stop

        async def flush_first() -> None:
            order.append("conversations")
            await flush()

        def stop_then() -> None:
            order.append("engine")
            stop()

        server.sessions.flush, server.engine.stop = flush_first, stop_then
    assert order == ["conversations", "engine"]
    stored = await RedisSessionStore(redis_server.url, retention_s=60).get(session_id)
    assert stored.version == 1
