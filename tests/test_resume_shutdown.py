"""A dropped socket resumes a reply exactly; a vanished client's turn is still recorded; SIGTERM drains
running turns (or cancels them at the deadline), flushes the sessions and exits 0."""

import asyncio
import signal

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import InvalidStatus
from websockets.frames import Close, CloseCode, Frame, Opcode
from websockets.protocol import State

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings
from sessions.redis_store import RedisSessionStore
from tests.test_deploy import start_worker

QUESTION = "Tell me everything about bicycle maintenance."


async def reference_reply(tiny) -> list[str]:
    async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session()).session_id
            turn = await client.chat(session_id, QUESTION, max_new_tokens=400)
            await turn.result()
            return turn.deltas


async def test_a_dropped_socket_resumes_the_reply_exactly(tiny):
    expected = await reference_reply(tiny)
    async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
        await server.wait_ready()
        first = await ChatClient.connect(server.url)
        session_id = (await first.open_session()).session_id
        turn = await first.chat(session_id, QUESTION, turn_id="long-1", max_new_tokens=400)
        received = [await anext(turn)]
        first._websocket.transport.abort()  # the network drops: no close handshake
        await first.close()
        assert server.gateway.turn_logs.get(None, "long-1").running  # resumed mid-reply, not after it
        async with ChatClient(await connect(server.url)) as second:
            assert (await second.open_session(session_id=session_id)).session_id == session_id
            resumed = await second.resume("long-1", last_seq=turn.last_seq)
            done = await resumed.result()
            assert received + resumed.deltas == expected
            assert done.content == "".join(expected)
            again = await second.resume("long-1", last_seq=-1)  # the whole log, while it is kept
            await again.result()
            assert again.deltas == expected
            ready = await second.open_session(session_id=session_id)
            assert ready.turns == 1 and ready.history[1].content == done.content


async def test_a_vanished_clients_turn_is_recorded_and_an_expired_log_is_unknown(tiny):
    async with ChatServer(Settings(port=0, turn_log_ttl_s=0.2), load=lambda: tiny) as server:
        await server.wait_ready()
        client = await ChatClient.connect(server.url)
        session_id = (await client.open_session()).session_id
        turn = await client.chat(session_id, QUESTION, turn_id="gone", max_new_tokens=50)
        await anext(turn)
        await client.close()  # the client leaves for good
        async with ChatClient(await connect(server.url)) as later:
            for _ in range(100):
                if (ready := await later.open_session(session_id=session_id)).turns == 1:
                    break
                await asyncio.sleep(0.05)
            assert ready.turns == 1 and ready.history[1].content
            await asyncio.sleep(0.3)
            with pytest.raises(ChatError, match="unknown_turn"):
                await (await later.resume("gone", last_seq=0)).result()


async def test_a_resumed_turn_can_be_cancelled_from_the_new_connection(tiny):
    async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
        await server.wait_ready()
        first = await ChatClient.connect(server.url)
        session_id = (await first.open_session()).session_id
        turn = await first.chat(session_id, QUESTION, turn_id="to-cancel", max_new_tokens=400)
        await anext(turn)
        first._websocket.transport.abort()
        await first.close()
        async with ChatClient(await connect(server.url)) as second:
            resumed = await second.resume("to-cancel", last_seq=turn.last_seq)
            await second.cancel("to-cancel")
            assert (await resumed.result()).finish_reason in ("cancelled", "length")
            assert (await second.open_session(session_id=session_id)).turns in (0, 1)


@pytest.mark.parametrize(("timeout_s", "recorded"), [(60, True), (0, False)])
async def test_sigterm_drains_running_turns_and_exits_cleanly(tiny_checkpoint, redis_db, timeout_s, recorded):
    worker = start_worker(tiny_checkpoint, redis_db.url, "--shutdown-timeout-s", str(timeout_s))
    url = f"ws://127.0.0.1:{worker.port}/ws"
    async with ChatClient(await connect(url)) as client:
        session_id = (await client.open_session()).session_id
        await (await client.chat(session_id, "first", max_new_tokens=4)).result()
        running = await client.chat(session_id, QUESTION, max_new_tokens=400)
        await anext(running)
        worker.process.send_signal(signal.SIGTERM)
        for _ in range(100):  # new connections are refused at once, while the running turn goes on
            try:
                probe = await connect(url, open_timeout=1)
                await probe.close()
                await asyncio.sleep(0.05)
            except (OSError, InvalidStatus):
                break
        else:
            raise AssertionError("the server kept accepting connections after SIGTERM")
        if recorded:
            assert (await running.result()).finish_reason == "length"
        else:  # (cut by the drain: the client is told to send it again)
            with pytest.raises(ChatError) as cut:
                await running.result()
            assert (cut.value.code, cut.value.retryable) == ("unavailable", True)
    assert await asyncio.to_thread(worker.process.wait, 30) == 0
    stored = await RedisSessionStore(redis_db.url, retention_s=60).get(session_id)
    assert stored.turns == (2 if recorded else 1)


async def test_shutdown_closes_a_connection_whose_client_closed_it_a_moment_before(tiny):
    """The client's close frame arrives in the same loop turn as the shutdown (seen in CI as an exit code 1)."""
    async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            await client.open_session()
            (protocol,) = server._uvicorn.server_state.connections
            close = Frame(Opcode.CLOSE, Close(CloseCode.NORMAL_CLOSURE, "bye").serialize())
            protocol.data_received(close.serialize(mask=True, extensions=[]))
            assert protocol.conn.state is State.CLOSING  # answered, not yet lost
            protocol.shutdown()
            assert protocol.transport.is_closing()
