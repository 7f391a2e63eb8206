"""The Responses WebSocket mode with SmolLM2 and the official `openai` SDK, each reply compared with the whole
conversation sent over HTTP to a server without session caches: a warm-up then turns on one lane, two lanes at once and
a fork, a stored chain continued on another worker through Redis, steering (a long reply stopped, a reply that ended,
a reply that stopped for a tool call), and a worker drained behind nginx while the SDK reconnects to the other."""

from __future__ import annotations

import asyncio

import openai
import pytest

from chatd.api.server import ChatServer
from chatd.cli.nginx_process import NginxProcess, nginx_binary
from chatd.config import Settings
from tests.test_e2e_smollm2 import SYSTEM

MODEL = "smollm2-135m"
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")
QUESTIONS = ["My internet is down since this morning.", "The router light is red.", "I restarted it already."]


def client_for(server: ChatServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none", max_retries=0)


async def reference_reply(reference: ChatServer, history: list[dict], tokens: int = 24) -> str:
    """The reply to the whole conversation, sent over HTTP to a server that keeps no cache."""
    response = await client_for(reference).responses.create(model=MODEL, instructions=SYSTEM, input=history,
                                                            max_output_tokens=tokens, temperature=0, store=False)
    return response.output_text


async def collect(connection, count: int) -> tuple[list, dict]:
    """Events until `count` responses ended: all of them, and each lane's last end."""
    events, ends = [], {}
    async for event in connection:
        events.append(event)
        if event.type in ENDS:
            ends[event.stream_id] = event
            if sum(e.type in ENDS for e in events) == count:
                return events, ends
    raise AssertionError("the socket closed")


@pytest.fixture
async def pair(smollm2):
    async with ChatServer(Settings(port=0, verify_sample_rate=0.0), load=lambda: smollm2) as server, \
            ChatServer(Settings(port=0, session_cache=False), load=lambda: smollm2) as reference:
        await server.wait_ready()
        await reference.wait_ready()
        yield server, reference


async def test_a_warm_up_then_three_turns_read_the_cache_and_equal_the_whole_conversation(pair):
    server, reference = pair
    async with client_for(server).responses.connect() as connection:
        await connection.response.create(model=MODEL, instructions=SYSTEM, input=[], generate=False)
        warm = (await collect(connection, 1))[1][None].response
        assert warm.output == [] and warm.usage.output_tokens == 0 and warm.usage.input_tokens > 20
        history, previous = [], warm
        for index, question in enumerate(QUESTIONS):
            history.append({"role": "user", "content": question})
            await connection.response.create(model=MODEL, input=question, previous_response_id=previous.id,
                                              max_output_tokens=32, temperature=0)
            previous = (await collect(connection, 1))[1][None].response
            assert previous.output_text == await reference_reply(reference, history, 32), f"turn {index + 1}"
            usage = previous.usage
            if index == 0:
                assert usage.input_tokens_details.cached_tokens >= warm.usage.input_tokens
            else:
                assert usage.input_tokens - usage.input_tokens_details.cached_tokens < 40, (index, usage)
            history.append({"role": "assistant", "content": previous.output_text})


async def test_two_lanes_at_once_interleave_and_a_fork_reads_its_parent(pair):
    server, reference = pair
    async with client_for(server).responses.connect() as connection:
        for lane, question in (("alice", QUESTIONS[0]), ("bob", "How do I pay my bill online?")):
            await connection.response.create(model=MODEL, instructions=SYSTEM, input=question, stream_id=lane,
                                              max_output_tokens=32, temperature=0)
        events, ends = await collect(connection, 2)
        assert {event.stream_id for event in events} == {"alice", "bob"}
        deltas = [event.stream_id for event in events if event.type == "response.output_text.delta"]
        first_bob, last_alice = deltas.index("bob"), len(deltas) - 1 - deltas[::-1].index("alice")
        assert first_bob < last_alice, "the lanes' deltas interleave (one batched decode)"
        assert ends["alice"].response.output_text == await reference_reply(
            reference, [{"role": "user", "content": QUESTIONS[0]}], 32)
        assert ends["bob"].response.output_text == await reference_reply(
            reference, [{"role": "user", "content": "How do I pay my bill online?"}], 32)
        parent = ends["alice"].response
        await connection.response.create(model=MODEL, input="Is it fixed by tomorrow?", stream_id="fork",
                                          previous_response_id=parent.id, max_output_tokens=24, temperature=0)
        fork = (await collect(connection, 1))[1]["fork"].response
        assert fork.output_text == await reference_reply(reference, [
            {"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": parent.output_text},
            {"role": "user", "content": "Is it fixed by tomorrow?"}])
        assert fork.usage.input_tokens_details.cached_tokens >= parent.usage.total_tokens - 1  # all its parent


async def test_a_steer_stops_the_reply_and_its_successor_continues_it_from_the_cache(pair):
    server, _ = pair
    async with client_for(server).responses.connect() as connection:
        await connection.response.create(model=MODEL, instructions=SYSTEM, max_output_tokens=200, temperature=0,
                                          input="Tell me everything about fibre, DSL and cable internet.")
        parent_id, events, deltas = None, [], 0
        async for event in connection:
            events.append(event)
            if event.type == "response.created" and parent_id is None:
                parent_id = event.response.id
            if event.type == "response.output_text.delta":
                deltas += 1
                if deltas == 5:
                    await connection.response.steer(previous_response_id=parent_id,
                                                    input="Actually, just tell me the price of fibre.")
            if event.type in ENDS and event.response.id != parent_id:
                break
        kinds = [event.type for event in events]
        accepted = next(event for event in events if event.type == "response.steer.accepted")
        assert accepted.steer.previous_response_id == parent_id and accepted.stream_id is None
        parent = next(event for event in events if event.type == "response.incomplete" and
                      event.response.id == parent_id).response
        assert parent.incomplete_details.reason == "steered" and 5 <= parent.usage.output_tokens < 200
        successor_created = [event for event in events if event.type == "response.created"][1]
        assert kinds.index("response.incomplete") < kinds.index("response.created", 1)
        successor = events[-1].response
        assert successor_created.response.previous_response_id == parent_id == successor.previous_response_id
        assert successor.output_text and events[-1].stream_id is None
        assert successor.usage.input_tokens_details.cached_tokens >= \
            parent.usage.input_tokens + parent.usage.output_tokens - 1
        items = await client_for(server).responses.input_items.list(successor.id)
        assert [item.content[0].text for item in items.data] == ["Actually, just tell me the price of fibre."]
        await connection.response.steer(previous_response_id=parent_id, input="too late")
        assert (await connection.recv()).error.code == "response_not_active"


async def test_a_steer_of_a_reply_making_a_tool_call_waits_for_its_output(pair):
    server, _ = pair
    tools = [{"type": "function", "name": "check_line", "description": "Check the customer's line",
              "parameters": {"type": "object", "properties": {"customer": {"type": "string"}},
                             "required": ["customer"]}}]
    async with client_for(server).responses.connect() as connection:
        await connection.response.create(model=MODEL, instructions=SYSTEM, input="Check the line of customer 42.",
                                          tools=tools, tool_choice="required", max_output_tokens=64, temperature=0)
        created = await connection.recv()
        await connection.response.steer(previous_response_id=created.response.id, input="Be quick please.")
        events = []
        async for event in connection:
            events.append(event)
            if event.type == "response.steer.pending":
                break
        completed = next(event for event in events if event.type == "response.completed").response
        calls = [item for item in completed.output if item.type == "function_call"]
        pending = events[-1]
        assert calls and [(stub.type, stub.call_id, stub.name) for stub in pending.required_input] == \
            [("function_call_output", call.call_id, "check_line") for call in calls]
        await connection.response.create(model=MODEL, previous_response_id=completed.id, max_output_tokens=16,
                                          temperature=0, tools=tools, input=[
                                              {"type": "function_call_output", "call_id": call.call_id,
                                               "output": "the line is fine"} for call in calls])
        answer = (await collect(connection, 1))[1][None].response
        assert answer.status in ("completed", "incomplete") and answer.previous_response_id == completed.id
        items = await client_for(server).responses.input_items.list(answer.id)
        assert [item.type for item in items.data] == ["message"] + ["function_call_output"] * len(calls)
        assert items.data[0].content[0].text == "Be quick please."


async def test_a_stored_chain_goes_on_through_redis_on_another_worker(smollm2, redis_db):
    settings = dict(port=0, redis_url=redis_db.url, verify_sample_rate=0.0)
    async with ChatServer(Settings(**settings), load=lambda: smollm2) as first, \
            ChatServer(Settings(**settings), load=lambda: smollm2) as second, \
            ChatServer(Settings(port=0, session_cache=False), load=lambda: smollm2) as reference:
        for server in (first, second, reference):
            await server.wait_ready()
        async with client_for(first).responses.connect() as connection:
            await connection.response.create(model=MODEL, instructions=SYSTEM, input=QUESTIONS[0],
                                              max_output_tokens=16, temperature=0)
            await connection.response.create(model=MODEL, instructions=SYSTEM, input=QUESTIONS[1], store=False,
                                              stream_id="unstored", max_output_tokens=4, temperature=0)
            ends = (await collect(connection, 2))[1]
        stored, unstored = ends[None].response, ends["unstored"].response
        async with client_for(second).responses.connect() as connection:
            await connection.response.create(model=MODEL, input=QUESTIONS[1], previous_response_id=stored.id,
                                              max_output_tokens=16, temperature=0)
            answer = (await collect(connection, 1))[1][None].response
            assert answer.output_text == await reference_reply(reference, [
                {"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": stored.output_text},
                {"role": "user", "content": QUESTIONS[1]}], 16)
            await connection.response.create(model=MODEL, input="and?", previous_response_id=unstored.id)
            refused = (await collect(connection, 1))[1][None]
            assert (refused.type, refused.status, refused.error.code) == ("error", 400, "previous_response_not_found")


async def test_a_drained_worker_finishes_its_response_and_the_sdk_reconnects_to_the_other(smollm2, redis_db,
                                                                                        tmp_path):
    if nginx_binary() is None:
        pytest.skip("nginx is not installed (make test installs Debian's nginx-light where it can)")
    settings = dict(port=0, redis_url=redis_db.url, verify_sample_rate=0.0, shutdown_timeout_s=60)
    async with ChatServer(Settings(**settings), load=lambda: smollm2) as first, \
            ChatServer(Settings(**settings), load=lambda: smollm2) as second:
        await first.wait_ready()
        await second.wait_ready()
        nginx = NginxProcess([first, second], tmp_path)
        reconnects = []
        try:
            client = openai.AsyncOpenAI(base_url=f"{nginx.http_url}/v1", api_key="none", max_retries=0)
            async with client.responses.connect(on_reconnecting=reconnects.append) as connection:
                await connection.response.create(model=MODEL, instructions=SYSTEM, input=QUESTIONS[0],
                                                  max_output_tokens=48, temperature=0)
                created = await connection.recv()
                serving = next(s for s in (first, second) if s.response_sockets.open)
                other = second if serving is first else first
                draining = asyncio.create_task(serving.shutdown())
                events = []
                async for event in connection:
                    events.append(event)
                    if event.type in ENDS:
                        break
                done = events[-1].response
                assert done.id == created.response.id and events[-1].type != "response.failed"  # it finished
                assert done.output_text and done.usage.output_tokens > 8
                await draining  # (the socket closed 1001 once its response was sent)
                events = connection.__aiter__()  # reading on, as a client does: the SDK reconnects through nginx
                following = asyncio.ensure_future(anext(events))
                for _ in range(100):
                    if reconnects:
                        break
                    await asyncio.sleep(0.05)
                await connection.response.create(model=MODEL, input=QUESTIONS[1], previous_response_id=done.id,
                                                  max_output_tokens=8, temperature=0)
                while (event := await following).type not in ENDS:
                    following = asyncio.ensure_future(anext(events))
                answer = event.response
        finally:
            nginx.stop()
        assert [event.close_code for event in reconnects] == [1001]
        assert answer.previous_response_id == done.id and answer.output_text
        assert other.response_sockets.counts["creates"] == 1
