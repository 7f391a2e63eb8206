"""The websocket protocol against a real server on a real socket (tiny model)."""

import asyncio
import json
import threading
import urllib.error
import urllib.request

import httpx
import pytest
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings
from tests.support import TINY_CONTEXT


@pytest.fixture
async def server(tiny):
    async with ChatServer(Settings(port=0), load=lambda: tiny) as running:
        await running.wait_ready()
        yield running


async def ask(ws, message) -> dict:
    await ws.send(message if isinstance(message, (str, bytes)) else json.dumps(message))
    return json.loads(await ws.recv())


async def collect_turn(ws) -> tuple[list[dict], dict]:
    deltas = []
    while (event := json.loads(await ws.recv()))["type"] == "chat.delta":
        deltas.append(event)
    return deltas, event


@pytest.mark.parametrize(("frame", "names"), [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "JSON object"),
    (b"\x00\x01", "binary frames"),
    ({"type": "nope"}, "nope"),
    ({"content": "hi"}, "type"),
    ({"type": "chat.request", "session_id": "x"}, "content"),
    ({"type": "chat.request", "session_id": "x", "content": ""}, "content"),
    ({"type": "chat.request", "session_id": "x", "content": "hi", "params": {"max_new_tokens": "many"}},
     "params.max_new_tokens"),
    ({"type": "chat.request", "session_id": "x", "content": "hi", "params": {"temperature": -1}},
     "params.temperature"),
    ({"type": "chat.request", "session_id": "x", "content": "hi", "params": {"max_new_tokens": 10**9}},
     "params.max_new_tokens"),
    ({"type": "session.open", "system": 5}, "system"),
    ({"type": "session.open", "colour": "blue"}, "colour"),
    ({"type": "chat.cancel"}, "turn_id"),
    ({"type": "chat.request", "session_id": "x", "content": "hi", "params": {"seed": 2**64}}, "params.seed"),
    ('{"type": "chat.request", "session_id": "x", "content": "hi", "params": {"seed": 1%s}}' % ("0" * 5000),
     "invalid JSON"),
    ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
    ({"type": "session.open", "system": "be nice \ud800"}, "system: a lone surrogate"),
    ({"type": "chat.request", "session_id": "x", "content": "hi", "params": {"stop": ["\udfff"]}}, "params.stop.0"),
    ({"type": "typing", "session_id": "\udc00"}, "session_id"),
])
async def test_malformed_input_is_a_bad_request_and_the_connection_keeps_working(server, frame, names):
    async with connect(server.url) as ws:
        error = await ask(ws, frame)
        assert (error["type"], error["code"], error["retryable"]) == ("error", "bad_request", False)
        assert names in error["message"]
        ready = await ask(ws, {"type": "session.open"})
        assert ready["type"] == "session.ready"


async def test_a_turn_streams_deltas_in_order_and_reports_usage(server):
    async with connect(server.url) as ws:
        session = await ask(ws, {"type": "session.open", "system": "Be brief."})
        assert (session["turns"], session["resumed"]) == (0, False) and len(session["session_id"]) >= 22
        for turn, text in enumerate(["Hello!", "Where is my parcel?"]):
            await ws.send(json.dumps({"type": "chat.request", "session_id": session["session_id"],
                                      "turn_id": f"turn-{turn}", "content": text,
                                      "params": {"max_new_tokens": 12}}))
            deltas, done = await collect_turn(ws)
            assert [d["seq"] for d in deltas] == list(range(len(deltas)))
            assert all(d["turn_id"] == f"turn-{turn}" for d in deltas)
            assert done["type"] == "chat.done" and done["turn_id"] == f"turn-{turn}"
            assert "".join(d["delta"]["content"] for d in deltas) == done["content"]
            assert done["usage"]["completion_tokens"] == 12 and done["finish_reason"] == "length"
            assert set(done["timings"]) == {"queue_ms", "ttft_ms", "prefill_ms", "decode_ms", "total_ms",
                                            "tokens_per_s"}
            assert 0 < done["timings"]["ttft_ms"] <= done["timings"]["total_ms"]
            if turn == 0:
                assert done["cache"] == {"source": "miss", "miss_reason": "new", "cleared": [], "remote": None,
                                         "quantized": None}
            else:
                assert done["cache"] == {"source": "device", "miss_reason": None, "cleared": [], "remote": None,
                                         "quantized": None}
                assert 0 < done["usage"]["cached_tokens"] < done["usage"]["prompt_tokens"]


async def test_unknown_session(server):
    async with connect(server.url) as ws:
        error = await ask(ws, {"type": "chat.request", "session_id": "nope", "turn_id": "t", "content": "hi"})
        assert (error["code"], error["turn_id"]) == ("unknown_session", "t")
        assert (await ask(ws, {"type": "session.open", "session_id": "nope"}))["code"] == "unknown_session"
        assert (await ask(ws, {"type": "session.close", "session_id": "nope"}))["code"] == "unknown_session"


async def test_a_second_request_while_a_turn_runs_is_busy(server):
    async with connect(server.url) as ws:
        session_id = (await ask(ws, {"type": "session.open"}))["session_id"]
        request = {"type": "chat.request", "session_id": session_id, "content": "hi", "params": {"max_new_tokens": 300}}
        await ws.send(json.dumps({**request, "turn_id": "first"}))
        await ws.send(json.dumps({**request, "turn_id": "second"}))
        busy = None
        while (event := json.loads(await ws.recv()))["type"] != "chat.done":
            if event["type"] == "error":
                busy = event
        assert busy is not None and (busy["code"], busy["turn_id"], busy["retryable"]) == ("busy", "second", True)
        assert event["turn_id"] == "first"
        await ws.send(json.dumps({**request, "turn_id": "third", "params": {"max_new_tokens": 2}}))
        assert (await collect_turn(ws))[1]["type"] == "chat.done"


async def test_cancel_stops_the_turn_and_the_session_continues(server):
    async with ChatClient(await connect(server.url)) as client:
        session_id = (await client.open_session()).session_id
        await (await client.chat(session_id, "Hi.", max_new_tokens=4)).result()
        turn = await client.chat(session_id, "Write a long story.", max_new_tokens=400)
        await anext(turn)
        await client.cancel(turn.turn_id)
        done = await turn.result()
        assert done.finish_reason == "cancelled" and done.usage.completion_tokens < 400
        after = await (await client.chat(session_id, "Short answer please.", max_new_tokens=4)).result()
        assert after.finish_reason == "length" and after.cache.source == "device"
        reopened = await client.open_session(session_id=session_id)
        assert (reopened.resumed, reopened.turns) == (True, 2), "the cancelled turn is not recorded"


async def test_cancelling_an_unknown_turn(server):
    async with connect(server.url) as ws:
        error = await ask(ws, {"type": "chat.cancel", "turn_id": "never-started"})
        assert (error["code"], error["turn_id"]) == ("unknown_turn", "never-started")


async def test_too_long_is_reported_and_the_session_survives(server):
    async with ChatClient(await connect(server.url)) as client:
        session_id = (await client.open_session()).session_id
        with pytest.raises(ChatError) as too_long:
            await (await client.chat(session_id, "word " * TINY_CONTEXT)).result()
        assert too_long.value.code == "too_long" and str(TINY_CONTEXT) in too_long.value.message
        done = await (await client.chat(session_id, "hello", max_new_tokens=3)).result()
        assert done.usage.completion_tokens == 3


async def test_close_forgets_the_session_and_frees_its_cache(server):
    async with ChatClient(await connect(server.url)) as client:
        session_id = (await client.open_session()).session_id
        await (await client.chat(session_id, "hello", max_new_tokens=3)).result()
        assert session_id in server.engine.cache.device
        await client.close_session(session_id)
        with pytest.raises(ChatError) as gone:
            await (await client.chat(session_id, "again?")).result()
        assert gone.value.code == "unknown_session"
        for _ in range(50):
            if session_id not in server.engine.cache.device:
                break
            await asyncio.sleep(0.02)
        assert session_id not in server.engine.cache.device


async def test_a_session_continues_from_another_connection(server):
    async with ChatClient(await connect(server.url)) as first:
        session_id = (await first.open_session()).session_id
        await (await first.chat(session_id, "hello", max_new_tokens=3)).result()
    async with ChatClient(await connect(server.url)) as second:
        assert (await second.open_session(session_id=session_id)).turns == 1
        done = await (await second.chat(session_id, "me again", max_new_tokens=3)).result()
        assert done.cache.source == "device" and done.usage.cached_tokens > 0


def http_status(url: str) -> int:
    try:
        return urllib.request.urlopen(url, timeout=5).status
    except urllib.error.HTTPError as error:
        return error.code


async def test_healthz_is_503_while_loading_then_200(tiny):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return tiny

    async with ChatServer(Settings(port=0), load=slow_load) as running:
        base = f"http://127.0.0.1:{running.port}"
        assert await asyncio.to_thread(http_status, base + "/healthz") == 503
        async with httpx.AsyncClient(base_url=base) as http:  # (vLLM's routes too: 503, retry shortly; not a 500)
            for route, body in (("/tokenize", {"prompt": "hello"}), ("/detokenize", {"tokens": [1, 2]})):
                early = await http.post(route, json=body)
                assert early.status_code == 503 and early.headers["retry-after"], (route, early.text)
            release.set()
            await running.wait_ready()
            assert (await http.post("/tokenize", json={"prompt": "hello"})).json()["count"] > 0
        assert await asyncio.to_thread(http_status, base + "/healthz") == 200
        assert await asyncio.to_thread(http_status, base + "/elsewhere") == 404


async def test_beyond_max_waiting_a_request_is_busy_at_once(tiny):
    release = threading.Event()

    def slow_load():
        release.wait(30)
        return tiny

    async with ChatServer(Settings(port=0, max_waiting=2), load=slow_load) as running:
        async with ChatClient(await connect(running.url)) as client:
            sessions = [(await client.open_session()).session_id for _ in range(3)]
            queued = [await client.chat(session_id, "hello", max_new_tokens=2) for session_id in sessions[:2]]
            for _ in range(100):
                if running.engine.waiting == 2:
                    break
                await asyncio.sleep(0.01)
            with pytest.raises(ChatError) as busy:
                await (await client.chat(sessions[2], "hello", max_new_tokens=2)).result()
            assert (busy.value.code, busy.value.retryable) == ("busy", True) and "capacity" in busy.value.message
            release.set()
            for turn in queued:
                assert (await turn.result()).usage.completion_tokens == 2
            assert running.engine.waiting == 0
            again = await (await client.chat(sessions[2], "again", max_new_tokens=2)).result()
            assert again.finish_reason == "length"
