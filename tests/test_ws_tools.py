"""Tools on the websocket protocol, with the tiny model and a tool-aware (Hermes) template: a session opened
with tools gets calls in `chat.done`, a `chat.request` carrying tool results continues it, prefilling only the
results, from the device tier, the host tier, and another worker through Redis; replies equal a server without
the session cache; `chatd chat --tools` plays the functions; bad tool input is `bad_request`."""

from __future__ import annotations

import json
import subprocess
import sys

import jsonschema
import pytest
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings
from tests.support import two_workers_and_a_reference
from tests.test_remote_kv import wait_for_remote
from tests.test_tool_formats import REFUND, _hermes_model

TOOLS = [{"name": "refund", "description": "Refund an order.", "parameters": REFUND},
         {"name": "escalate", "parameters": {"type": "object", "properties": {}}}]
RESULT = '{"refunded": true}'


async def _tool_round(client: ChatClient, tiers=None) -> list:
    """A call forced by the session's tool choice, then its result sent back (and, with `tiers`, the cache moved
    before that turn); the replies' (deltas, chat.done)."""
    session_id = (await client.open_session(system="Support desk.", tools=TOOLS,
                                            tool_choice={"name": "refund"})).session_id
    called = await client.chat(session_id, "Refund order 7, please.", max_new_tokens=60)
    first = await called.result()
    if tiers is not None:
        tiers()
    answered = await client.send_tool_results(session_id, {call.id: RESULT for call in first.tool_calls},
                                              tool_fields={"tool_choice": "auto"}, max_new_tokens=12)
    second = await answered.result()
    return [session_id, (called.deltas, first), (answered.deltas, second)]


def _same_reply(got, expected) -> None:
    (got_deltas, got_done), (expected_deltas, expected_done) = got, expected
    assert "".join(got_deltas) == got_done.content and got_deltas == expected_deltas
    assert got_done.content == expected_done.content and got_done.finish_reason == expected_done.finish_reason
    assert [(c.name, c.arguments) for c in got_done.tool_calls] == \
        [(c.name, c.arguments) for c in expected_done.tool_calls]


@pytest.mark.parametrize("tier", ["device", "host"])
async def test_tool_results_continue_the_session_from_its_cache_and_answer_like_a_cacheless_server(tiny, tier):
    hermes = _hermes_model(tiny)
    async with ChatServer(Settings(port=0, model="tiny"), load=lambda: hermes) as server, \
            ChatServer(Settings(port=0, model="tiny", session_cache=False), load=lambda: hermes) as uncached:
        await server.wait_ready()
        await uncached.wait_ready()
        async with ChatClient(await connect(server.url)) as client, \
                ChatClient(await connect(uncached.url)) as reference:
            session_id, called, answered = await _tool_round(
                client, server.engine.offload_idle if tier == "host" else None)
            _, *expected = await _tool_round(reference)
            _same_reply(called, expected[0])
            _same_reply(answered, expected[1])
            first, second = called[1], answered[1]
            assert first.finish_reason == "tool_calls" and [c.name for c in first.tool_calls][0] == "refund"
            for call in first.tool_calls:
                assert call.id.startswith("call_")
                jsonschema.validate(json.loads(call.arguments), REFUND)
            assert second.cache.source == tier
            assert second.usage.cached_tokens >= first.usage.prompt_tokens + first.usage.completion_tokens - 1
            ready = await client.open_session(session_id=session_id)
            assert [m.role for m in ready.history] == ["user", "assistant"] + ["tool"] * len(first.tool_calls) + \
                ["assistant"]
            assert ready.history[1].tool_calls == first.tool_calls and ready.history[1].content == first.content
            assert ready.history[2].tool_call_id == first.tool_calls[0].id and ready.history[2].content == RESULT


async def test_another_worker_continues_a_tool_round_from_the_cache_in_redis(tiny, redis_db):
    hermes = _hermes_model(tiny)
    settings = Settings(port=0, model="tiny", redis_url=redis_db.url, remote_kv=True, remote_kv_fetch="always")
    async with two_workers_and_a_reference(hermes, settings) as (on_a, on_b, reference, servers):
        session_id = (await on_a.open_session(system="Support desk.", tools=TOOLS,
                                              tool_choice={"name": "refund"})).session_id
        first = await (await on_a.chat(session_id, "Refund order 7, please.", max_new_tokens=60)).result()
        assert first.tool_calls
        await wait_for_remote(redis_db.url, session_id, 1)
        results = {call.id: RESULT for call in first.tool_calls}
        answered = await on_b.send_tool_results(session_id, results, max_new_tokens=60)
        done = await answered.result()
        assert done.cache.source == "remote" and done.usage.cached_tokens >= first.usage.prompt_tokens
        assert done.tool_calls, "worker B read the session's tools from Redis: its tool choice still holds"
        reference_id = (await reference.open_session(system="Support desk.", tools=TOOLS,
                                                     tool_choice={"name": "refund"})).session_id
        expected_first = await (await reference.chat(reference_id, "Refund order 7, please.",
                                                     max_new_tokens=60)).result()
        assert [(c.name, c.arguments) for c in expected_first.tool_calls] == \
            [(c.name, c.arguments) for c in first.tool_calls]
        expected = await (await reference.send_tool_results(
            reference_id, {call.id: RESULT for call in expected_first.tool_calls}, max_new_tokens=60)).result()
        assert [(c.name, c.arguments) for c in done.tool_calls] == [(c.name, c.arguments) for c in expected.tool_calls]


async def test_bad_tool_input_is_a_bad_request_and_the_session_goes_on(tiny):
    async with ChatServer(Settings(port=0, model="tiny"), load=lambda: _hermes_model(tiny)) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            refusals = [
                (client.open_session(tools=[{"name": "f", "parameters": {"type": 7}}]), "tools[0].parameters"),
                (client.open_session(tools=TOOLS, tool_choice={"name": "cancel"}), "cancel"),
                (client.open_session(tools=[{"description": "no name"}]), "tools.0.name"),
                (client.open_session(response_format={"type": "json_schema", "schema": {"type": 7}}),
                 "response_format.schema"),
            ]
            for call, named in refusals:
                with pytest.raises(ChatError) as refused:
                    await call
                assert refused.value.code == "bad_request" and named in refused.value.message, refused.value
            session_id = (await client.open_session(tools=TOOLS)).session_id
            for turn, named in [
                (client.send_tool_results(session_id, {"call_nobody": "{}"}), "tool_results[0].call_id"),
                (client.chat(session_id, "Hi", tool_fields={"tool_choice": "required", "tools": []}), "tool_choice"),
                (client.chat(session_id, "Hi", tool_fields={"response_format": {"type": "json_schema", "schema": {
                    "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}), "response_format"),
            ]:
                with pytest.raises(ChatError) as refused:
                    await (await turn).result()
                assert refused.value.code == "bad_request" and named in refused.value.message, refused.value
            done = await (await client.chat(session_id, "Hi", max_new_tokens=4)).result()
            assert done.usage.completion_tokens >= 1 and done.usage.prompt_tokens > 0, "the session goes on"


def test_chatd_chat_with_tools_asks_for_each_calls_result(tiny_checkpoint, tmp_path):
    (tmp_path / "tools.json").write_text(json.dumps(TOOLS))
    server = subprocess.Popen([sys.executable, "-m", "chatd", "serve", "--model", str(tiny_checkpoint), "--port", "0",
                               "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        url = server.stdout.readline().split("ws://")[1].split()[0]
        terminal = subprocess.run(
            [sys.executable, "-m", "chatd", "chat", "--url", f"ws://{url}", "--tools", str(tmp_path / "tools.json"),
             "--tool-choice", "refund", "--max-new-tokens", "60"],
            input=f"Refund order 7\n{RESULT}\n", capture_output=True, text=True, timeout=120)
        assert terminal.returncode == 0, terminal.stderr
        assert "call> refund(" in terminal.stdout and "result of refund(" in terminal.stdout
        summaries = [line for line in terminal.stderr.splitlines() if "prompt tokens" in line]
        assert len(summaries) >= 2 and summaries[1].startswith("[device"), terminal.stderr
    finally:
        server.terminate()
        server.wait(30)
