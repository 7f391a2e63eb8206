"""Authentication, session isolation between keys, browser origins and every limit, through a real
server and real websocket clients (tiny model)."""

import asyncio
import json
import logging
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed, InvalidStatus

from chatd.api.server import ChatServer
from chatd.api.turn_errors import ErrorMessage
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings

KEY_A, KEY_B = "sk-alpha-0123456789abcdef", "sk-bravo-fedcba9876543210"


async def reply(websocket) -> dict:
    return json.loads(await asyncio.wait_for(websocket.recv(), 30))


async def ask(websocket, message: dict) -> dict:
    await websocket.send(json.dumps(message))
    return await reply(websocket)


async def test_keys_are_required_checked_and_never_logged(tiny, caplog):
    caplog.set_level(logging.DEBUG, logger="chatd")
    caplog.set_level(logging.INFO, logger="websockets")  # what `chatd serve --log-level debug` keeps
    async with ChatServer(Settings(port=0, api_key=[KEY_A, KEY_B]), load=lambda: tiny) as server:
        await server.wait_ready()
        async with connect(server.url) as websocket:
            refused = await ask(websocket, {"type": "session.open"})
            assert refused["code"] == "unauthorized" and "auth" in refused["message"]
            assert (await ask(websocket, {"type": "auth", "token": "sk-wrong"}))["code"] == "unauthorized"
            assert (await ask(websocket, {"type": "auth", "token": KEY_A}))["type"] == "auth.ok"
            ready = await ask(websocket, {"type": "session.open"})
            assert ready["type"] == "session.ready" and len(ready["session_id"]) >= 22  # 128 random bits
        async with ChatClient(await connect(server.url, additional_headers={"Authorization": f"Bearer {KEY_B}"})) \
                as client:
            assert (await client.open_session()).session_id
        with pytest.raises(InvalidStatus) as wrong_header:
            await connect(server.url, additional_headers={"Authorization": "Bearer sk-nope"})
        assert wrong_header.value.response.status_code == 401
        async with connect(server.url) as websocket:  # guessing keys gets the connection closed
            for attempt in range(5):
                await websocket.send(json.dumps({"type": "auth", "token": f"guess-{attempt}"}))
            with pytest.raises(ConnectionClosed) as closed:
                while True:
                    await reply(websocket)
            assert closed.value.rcvd.code == 1008
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert KEY_A not in logged and KEY_B not in logged and "guess-" not in logged


async def test_another_keys_session_is_exactly_like_a_missing_one(tiny):
    async with ChatServer(Settings(port=0, api_key=[KEY_A, KEY_B]), load=lambda: tiny) as server:
        await server.wait_ready()
        alice = await ChatClient.connect(server.url, api_key=KEY_A)
        mallory = await ChatClient.connect(server.url, api_key=KEY_B)
        session_id = (await alice.open_session(system="Alice's bank assistant.")).session_id
        turn = await alice.chat(session_id, "My account number is 12345.", turn_id="alice-1", max_new_tokens=4)
        await turn.result()

        async def answers(client, message: dict, missing: dict) -> tuple[ErrorMessage, ErrorMessage]:
            await client._send(message)
            theirs = await client._replies.get()
            await client._send(missing)
            return theirs, await client._replies.get()

        for message in ({"type": "session.open", "session_id": session_id},
                        {"type": "session.close", "session_id": session_id}):
            theirs, missing = await answers(mallory, message, {**message, "session_id": "x" * 22})
            assert theirs.code == missing.code == "unknown_session"
            assert theirs.message.replace(session_id, "ID") == missing.message.replace("x" * 22, "ID")
        with pytest.raises(ChatError, match="unknown_session"):
            await (await mallory.chat(session_id, "Read me the history.")).result()
        for kind in ("chat.cancel", "chat.resume"):
            await mallory._send({"type": kind, "turn_id": "alice-1"})
            assert (await mallory._replies.get()).code == "unknown_turn"
        await mallory._send({"type": "typing", "session_id": session_id})  # a hint: never answered
        # Alice's session is untouched: still one turn, and still hers.
        ready = await alice.open_session(session_id=session_id)
        assert ready.turns == 1 and ready.history[0].content == "My account number is 12345."
        await alice.close()
        await mallory.close()


async def test_origins_are_checked_for_browsers(tiny):
    settings = Settings(port=0, allowed_origins=["https://shop.example"])
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        async with connect(server.url, origin="https://shop.example") as websocket:
            assert (await ask(websocket, {"type": "session.open"}))["type"] == "session.ready"
        async with connect(server.url) as websocket:  # not a browser: no Origin header
            assert (await ask(websocket, {"type": "session.open"}))["type"] == "session.ready"
        async with connect(server.url, origin=f"http://127.0.0.1:{server.port}") as websocket:  # chatd's own UI
            assert (await ask(websocket, {"type": "session.open"}))["type"] == "session.ready"
        with pytest.raises(InvalidStatus) as refused:
            await connect(server.url, origin="https://evil.example")
        assert refused.value.response.status_code == 403


async def test_every_limit_has_its_error(tiny):
    settings = Settings(port=0, max_message_bytes=4096, max_prompt_tokens=50, max_new_tokens=64, max_connections=3,
                        max_sessions_per_connection=2, rate_limit_per_min=3)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        async with connect(server.url) as websocket:
            session_id = (await ask(websocket, {"type": "session.open"}))["session_id"]
            assert (await ask(websocket, {"type": "session.open"}))["type"] == "session.ready"
            over = await ask(websocket, {"type": "session.open"})
            assert over["code"] == "limit_exceeded" and "2 sessions" in over["message"]

            too_many_tokens = await ask(websocket, {"type": "chat.request", "session_id": session_id,
                                                    "content": "word " * 60, "params": {"max_new_tokens": 4}})
            assert too_many_tokens["code"] == "too_long" and "at most 50" in too_many_tokens["message"]
            capped = await ask(websocket, {"type": "chat.request", "session_id": session_id, "content": "hi",
                                           "params": {"max_new_tokens": 65}})
            assert capped["code"] == "limit_exceeded" and "cap of 64" in capped["message"]

            async def turn(content: str) -> dict:
                await websocket.send(json.dumps({"type": "chat.request", "session_id": session_id,
                                                 "content": content, "params": {"max_new_tokens": 2}}))
                while (message := await reply(websocket))["type"] == "chat.delta":
                    pass
                return message

            # The too_long turn spent one of the 3 per minute; two more pass, the next is refused.
            assert (await turn("one"))["type"] == "chat.done"
            assert (await turn("two"))["type"] == "chat.done"
            limited = await turn("three")
            assert limited["code"] == "rate_limited" and limited["retryable"] and 0 < limited["retry_after_s"] <= 20

            others = [await connect(server.url) for _ in range(2)]
            with pytest.raises(InvalidStatus) as full:
                await connect(server.url)
            assert full.value.response.status_code == 503
            for other in others:
                await other.close()

            await websocket.send(json.dumps({"type": "session.open", "system": "x" * 5000}))
            with pytest.raises(ConnectionClosed) as closed:
                await reply(websocket)
            assert closed.value.rcvd.code == 1009
        async with connect(server.url) as websocket:  # the server goes on serving
            assert (await ask(websocket, {"type": "session.open"}))["type"] == "session.ready"


def post_corrupt(url: str, key: str | None) -> int:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST", headers=headers), timeout=30) as answer:
            return answer.status
    except urllib.error.HTTPError as error:
        return error.code


async def test_fault_injection_needs_the_owners_key(tiny):
    settings = Settings(port=0, api_key=[KEY_A, KEY_B], enable_fault_injection=True)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        async with await ChatClient.connect(server.url, api_key=KEY_A) as client:
            session_id = (await client.open_session()).session_id
            await (await client.chat(session_id, "hello", max_new_tokens=2)).result()
        url = f"http://127.0.0.1:{server.port}/admin/sessions/{session_id}/corrupt?kind=nan&tier=device"
        assert await asyncio.to_thread(post_corrupt, url, None) == 401
        assert await asyncio.to_thread(post_corrupt, url, "sk-wrong-key-000000000000") == 401
        assert await asyncio.to_thread(post_corrupt, url, KEY_B) == 404  # as if it did not exist
        assert server.engine.cache.counters["corrupt_finite"] == 0
        assert await asyncio.to_thread(post_corrupt, url, KEY_A) == 200
