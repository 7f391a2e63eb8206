"""The engine never waits on the network: with every packet to and from Redis delayed, eight conversations
alternating between two `--remote-kv` workers (each turn's cache comes from Redis, as nginx would route them) stream
on while a turn waits for its cache in its own state, and every reply equals the reply through a direct Redis."""

import asyncio

from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from tests.delay_proxy import DelayProxy

DELAY_S = 0.05  # each way: a round trip to Redis takes 100 ms more
QUESTIONS = ["My parcel is late.", "It was sent on Monday.", "Where is it now?", "Thanks, and the refund?"]


async def conversations(tiny, url: str, count: int = 8) -> tuple[list[list[tuple[str, ...]]], list, list]:
    """`count` conversations at once, each turn on the other worker of a pair sharing `url`: every conversation's
    replies (as streamed), every turn's `chat.done`, and the two engines."""
    # Every turn fetches (what is tested is the wait, not the cost model: the tiny model's prefill is as fast as a
    # round trip), and waits as long as the Redis calls may take.
    settings = Settings(port=0, redis_url=url, remote_kv=True, remote_kv_fetch="always")
    async with ChatServer(settings, load=lambda: tiny) as a, ChatServer(settings, load=lambda: tiny) as b:
        for server in (a, b):
            await server.wait_ready()
        async with ChatClient(await connect(a.url)) as on_a, ChatClient(await connect(b.url)) as on_b:
            dones = []

            async def conversation(number: int) -> list[tuple[str, ...]]:
                session_id = (await on_a.open_session(system=f"You help customer {number}.")).session_id
                replies = []
                for turn_number, question in enumerate(QUESTIONS):
                    client = (on_a, on_b)[turn_number % 2]
                    turn = await client.chat(session_id, question, max_new_tokens=12)
                    dones.append(await turn.result())
                    replies.append(tuple(turn.deltas))
                return replies

            replies = await asyncio.gather(*(conversation(number) for number in range(count)))
            return replies, dones, [a.engine, b.engine]


async def test_eight_conversations_stream_on_while_turns_wait_for_a_far_redis(tiny, redis_server, redis_db):
    with DelayProxy(redis_server.port, DELAY_S) as proxy:
        far, far_dones, engines = await conversations(tiny, proxy.url())
    near, _, _ = await conversations(tiny, redis_db.url)
    assert far == near, "every reply, piece by piece, as through a direct Redis"
    fetched = [done for done in far_dones if done.cache.source == "remote"]
    assert len(fetched) >= 8, "later turns continue from the other worker's copy in Redis"
    assert all(done.cache.remote.choice == "fetch" for done in fetched)
    assert sum(engine.counts.steps_beside_fetches for engine in engines) > 0, \
        "the batch decoded on while turns waited for their caches"
