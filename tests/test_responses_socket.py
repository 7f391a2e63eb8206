"""The Responses WebSocket mode's protocol with the tiny model and the official `openai` SDK (`client.responses
.connect()`, async and sync): the handshake and its keys, every error before a response exists (each on a socket that
then serves a normal turn), lanes and their limits, steering refusals, a warm-up read by the next turn, the
connection's time limit, and a client that leaves mid-response (nothing of it kept)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import websockets
from websockets.asyncio.client import connect

from chatd.api.openai import responses_socket
from chatd.api.server import ChatServer
from chatd.config import Settings

MODEL = "tiny-test"
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


def client_for(server: ChatServer, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)


async def next_end(connection) -> object:
    """Events up to the next end of a response (or an error event): the last one."""
    async for event in connection:
        if event.type in ENDS:
            return event
    raise AssertionError("the socket closed")


async def a_normal_turn(connection, **extra) -> object:
    await connection.response.create(model=MODEL, input="Hello", max_output_tokens=4, temperature=0, **extra)
    end = await next_end(connection)
    assert end.type in ("response.completed", "response.incomplete") and end.response.usage.output_tokens == 4
    return end


@pytest.fixture
async def server(tiny):
    async with ChatServer(Settings(port=0, model=MODEL, verify_sample_rate=0.0, api_key=["key-a", "key-b"]),
                          load=lambda: tiny) as running:
        await running.wait_ready()
        yield running


async def test_no_socket_without_a_key_and_another_key_cannot_continue_a_response(server):
    for headers in ({}, {"Authorization": "Bearer wrong"}):
        with pytest.raises(websockets.InvalidStatus) as refused:
            await connect(f"ws://127.0.0.1:{server.port}/v1/responses", additional_headers=headers)
        assert refused.value.response.status_code == 401
        assert b'"code":"invalid_api_key"' in refused.value.response.body.replace(b" ", b"")
    async with client_for(server, "key-a").responses.connect(extra_query={"ignored": "1"}) as connection:
        mine = await a_normal_turn(connection)
    async with client_for(server, "key-b").responses.connect() as connection:
        await connection.response.create(model=MODEL, input="Go on", previous_response_id=mine.response.id)
        refused = await next_end(connection)
        assert (refused.type, refused.status, refused.error.code) == ("error", 400, "previous_response_not_found")
        await a_normal_turn(connection)


async def test_every_error_before_a_response_is_an_error_event_and_the_socket_goes_on(server):
    async with client_for(server, "key-a").responses.connect() as connection:
        cases = [
            ({"type": "response.create", "model": MODEL, "input": "x", "stream_id": "bad id!"},
             400, "invalid_stream_id", None),
            ({"type": "response.create", "model": MODEL, "input": "x", "stream_id": "a" * 257},
             400, "invalid_stream_id", None),
            ({"type": "response.create", "model": MODEL, "input": "x", "background": True, "stream_id": "bg"},
             400, "unsupported_parameter", "bg"),
            ({"type": "response.create", "model": MODEL, "input": "x", "previous_response_id": "resp_nope",
              "stream_id": "lane-1"}, 400, "previous_response_not_found", "lane-1"),
            ({"type": "response.create", "model": "gpt-9", "input": "x"}, 404, "model_not_found", None),
            ({"type": "response.create", "model": MODEL, "input": "x", "max_output_tokens": 0}, 400,
             "invalid_request_error", None),
            ({"type": "response.create", "model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, 400,
             "bad_request", None),
            ({"type": "response.dance"}, 400, "invalid_event", None),
        ]
        for event, status, code, lane in cases:
            await connection.send(event)
            error = await next_end(connection)
            assert (error.type, error.status, error.error.code, error.stream_id) == ("error", status, code, lane), \
                event
        await connection._connection.send("not json")  # (the SDK only sends JSON)
        assert (await next_end(connection)).error.code == "invalid_json"
        await a_normal_turn(connection, stream=True)  # `stream` is ignored


async def test_lanes_carry_their_stream_id_and_are_limited_per_connection(server, monkeypatch):
    monkeypatch.setattr(responses_socket, "MAX_LANES", 3)
    async with client_for(server, "key-a").responses.connect() as connection:
        for lane in ("a", "b", "c", "d"):
            await connection.response.create(model=MODEL, input=f"lane {lane}", max_output_tokens=3, temperature=0,
                                             stream_id=lane)
        await connection.response.create(model=MODEL, input="default lane", max_output_tokens=3, temperature=0)
        ends, lanes_seen = {}, set()
        async for event in connection:
            lanes_seen.add(event.stream_id)
            if event.type in ENDS:
                ends[event.stream_id] = event
                if len(ends) == 5:
                    break
        assert ends["d"].type == "error" and ends["d"].error.code == "websocket_stream_limit_reached"
        assert all(ends[lane].type == "response.incomplete" for lane in ("a", "b", "c", None))
        assert lanes_seen == {"a", "b", "c", "d", None}
        # A lane continues its own chain: FIFO within it.
        await connection.response.create(model=MODEL, input="again", max_output_tokens=3, temperature=0,
                                          stream_id="a", previous_response_id=ends["a"].response.id)
        again = await next_end(connection)
        assert again.stream_id == "a" and again.response.previous_response_id == ends["a"].response.id
        assert again.response.usage.input_tokens_details.cached_tokens >= ends["a"].response.usage.total_tokens - 2


async def test_steering_refusals_return_the_input(server):
    async with client_for(server, "key-a").responses.connect() as connection:
        done = await a_normal_turn(connection)
        cases = [("resp_unknown", "hi", "response_not_found"),
                 (done.response.id, "hi", "response_not_active"),  # (it ended incomplete: max_output_tokens)
                 (done.response.id, [{"role": "assistant", "content": "no"}], "invalid_input"),
                 (done.response.id, "", "invalid_input")]
        for previous, value, code in cases:
            await connection.response.steer(previous_response_id=previous, input=value)
            failed = await connection.recv()
            assert (failed.type, failed.error.code, failed.steer.input) == ("response.steer.failed", code, value)
        await connection.response.create(model=MODEL, input="Hi", generate=False)
        completed = await next_end(connection)
        assert completed.type == "response.completed"
        await connection.response.steer(previous_response_id=completed.response.id, input="more")
        assert (await connection.recv()).error.code == "response_already_completed"
        await a_normal_turn(connection)


async def test_a_warm_up_prefills_and_the_next_turn_reads_it(server):
    async with client_for(server, "key-a").responses.connect() as connection:
        await connection.response.create(model=MODEL, instructions="Be brief.", input="My router is red.",
                                          generate=False)
        kinds = []
        async for event in connection:
            kinds.append(event.type)
            if event.type in ENDS:
                break
        warm = event.response
        assert kinds == ["response.created", "response.in_progress", "response.completed"]
        assert warm.output == [] and warm.usage.output_tokens == 0 and warm.usage.input_tokens > 10
        await connection.response.create(model=MODEL, input="What now?", previous_response_id=warm.id,
                                          max_output_tokens=4, temperature=0)
        turn = (await next_end(connection)).response
        assert turn.usage.input_tokens_details.cached_tokens == warm.usage.input_tokens
    stored = await client_for(server, "key-a").responses.input_items.list(turn.id)
    assert [item.content[0].text for item in stored.data] == ["What now?"]


async def test_the_connection_ends_after_its_time_with_1001(tiny):
    async with ChatServer(Settings(port=0, model=MODEL, responses_ws_max_age_s=1.5), load=lambda: tiny) as server:
        await server.wait_ready()
        async with connect(f"ws://127.0.0.1:{server.port}/v1/responses") as websocket:
            await asyncio.sleep(1.6)
            error = await websocket.recv()
            assert '"code":"websocket_connection_limit_reached"' in error
            with pytest.raises(websockets.ConnectionClosed) as closed:
                await websocket.recv()
            assert closed.value.rcvd.code == 1001
        assert server.response_sockets.live()["connections"] == 0


async def test_a_client_that_leaves_cancels_its_response_and_nothing_is_kept(server):
    connection = await client_for(server, "key-a").responses.connect().enter()
    await connection.response.create(model=MODEL, input="A long story please", max_output_tokens=500,
                                      temperature=0)
    created = await connection.recv()
    await connection.recv()  # in progress
    await connection.close()
    for _ in range(100):
        if not server.turns.running_turns:
            break
        await asyncio.sleep(0.05)
    assert not server.turns.running_turns
    with pytest.raises(openai.NotFoundError):
        await client_for(server, "key-a").responses.retrieve(created.response.id)


async def test_the_sync_client_connects_and_chains(server):
    def chat() -> object:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="key-a", max_retries=0)
        with client.responses.connect() as connection:
            ids = []
            for text in ("Hello", "And again"):
                connection.response.create(model=MODEL, input=text, max_output_tokens=3, temperature=0,
                                           **({"previous_response_id": ids[-1]} if ids else {}))
                for event in connection:
                    if event.type in ENDS:
                        break
                assert event.type == "response.incomplete"
                ids.append(event.response.id)
            return event

    last = await asyncio.to_thread(chat)
    assert last.response.usage.input_tokens_details.cached_tokens > 0
    async with httpx.AsyncClient() as http:
        stats = (await http.get(f"http://127.0.0.1:{server.port}/v1/stats")).json()
    assert stats["now"]["responses_websocket"]["creates"] >= 2
    metrics = (await httpx.AsyncClient().get(f"http://127.0.0.1:{server.port}/metrics")).text
    assert "chatd:responses_ws_creates_total" in metrics
