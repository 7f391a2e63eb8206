"""One turn per session, always: a session open on two connections whose turns arrive at the same
moment while Redis hangs (a real redis-server stopped with SIGSTOP). Every request gets chat.done or
busy, the replies that completed are the replies of the same conversation run alone on a server
without a session cache, token for token, and nothing is logged at ERROR."""

import asyncio
import logging
import signal

import pytest
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings

SYSTEM = "You are a support agent for Northwind Internet. Answer briefly."
ROUNDS = [("What colour is the router light when it works?", "What is zero plus zero?"),
          ("How do I reset the router?", "How many days are in a week?"),
          ("Is there an outage in my area?", "Can I pay by card?")]
TOKENS = 12


async def outcome(turn) -> tuple[str, list[str]]:
    try:
        await asyncio.wait_for(turn.result(), 120)
    except ChatError as error:
        assert error.code == "busy" and error.retryable, error
        return "busy", []
    return "done", turn.deltas


async def test_racing_turns_on_one_session_during_a_redis_outage(tiny, redis_server, caplog):
    caplog.set_level(logging.WARNING)
    async with ChatServer(Settings(port=0, redis_url=redis_server.url), load=lambda: tiny) as server, \
            ChatServer(Settings(port=0, session_cache=False), load=lambda: tiny) as alone:
        await server.wait_ready()
        await alone.wait_ready()
        async with ChatClient(await connect(server.url)) as tab, ChatClient(await connect(server.url)) as bot:
            session_id = (await tab.open_session(system=SYSTEM)).session_id
            assert (await bot.open_session(session_id=session_id)).resumed
            opening = await tab.chat(session_id, "Hello, my internet is slow.", max_new_tokens=TOKENS)
            await opening.result()
            completed = [("Hello, my internet is slow.", opening.deltas)]
            redis_server.process.send_signal(signal.SIGSTOP)
            try:
                for tab_question, bot_question in ROUNDS:
                    turns = await asyncio.gather(tab.chat(session_id, tab_question, max_new_tokens=TOKENS),
                                                 bot.chat(session_id, bot_question, max_new_tokens=TOKENS))
                    outcomes = await asyncio.gather(*(outcome(turn) for turn in turns))
                    assert sorted(kind for kind, _ in outcomes) == ["busy", "done"], outcomes
                    for question, (kind, deltas) in zip((tab_question, bot_question), outcomes, strict=True):
                        if kind == "done":
                            completed.append((question, deltas))
            finally:
                redis_server.process.send_signal(signal.SIGCONT)
            for _ in range(200):  # the writes queued during the outage reach Redis
                if server.sessions.pending_writes == 0:
                    break
                await asyncio.sleep(0.05)
            assert server.sessions.pending_writes == 0
            ready = await tab.open_session(session_id=session_id)
            assert [m.content for m in ready.history if m.role == "user"] == [q for q, _ in completed]

        async with ChatClient(await connect(alone.url)) as reference:
            reference_id = (await reference.open_session(system=SYSTEM)).session_id
            for question, deltas in completed:
                expected = await reference.chat(reference_id, question, max_new_tokens=TOKENS)
                await expected.result()
                assert deltas == expected.deltas, f"the reply to {question!r} depends on another request"
    errors = [record for record in caplog.records if record.levelno >= logging.ERROR]
    assert not errors, [record.getMessage() for record in errors]


@pytest.fixture(autouse=True)
def _resume_redis_on_failure(redis_server):
    """A failed assertion must not leave redis-server stopped for the fixture's teardown."""
    yield
    if redis_server.process is not None:
        redis_server.process.send_signal(signal.SIGCONT)
