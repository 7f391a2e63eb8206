"""Hostile and heavy clients against a live server (tiny model, loopback only, bounded in time and
count): protocol fuzzing with hypothesis, floods, huge and malformed frames, 500 idle connections
beside 16 chatting sessions, and 32 concurrent sessions of two keys under eviction churn."""

import asyncio
import json
import logging
import string
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as connect_sync

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings

SERVER_TYPES = {"auth.ok", "session.ready", "session.closed", "chat.delta", "chat.done", "error"}
CLIENT_TYPES = ["auth", "session.open", "chat.request", "chat.cancel", "chat.resume", "typing", "session.close"]
SENTINEL = json.dumps({"type": "chat.cancel", "turn_id": "sentinel"})  # always answered: unknown_turn

# Lone surrogates too: "\ud800" is valid JSON but not text, and must not reach the tokenizer or Redis.
texts = st.text(max_size=40) | st.text(st.characters(categories=["Cs", "Ll"]), max_size=8)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=12)
messages = st.fixed_dictionaries(
    {"type": st.sampled_from(CLIENT_TYPES) | st.text(max_size=12)},
    optional={field: json_values | texts | st.text(alphabet=string.printable, max_size=30)
              for field in ("session_id", "turn_id", "content", "params", "token", "last_seq", "system")})
frames = st.one_of(
    messages.map(json.dumps),
    json_values.map(json.dumps),
    st.text(max_size=200),
    st.binary(max_size=64),
)


class ServerThread:
    """A live server on its own event loop, so that hypothesis (synchronous) can drive clients."""

    def __init__(self, loaded, **overrides):
        self.settings = Settings(port=0, **overrides)
        self.loaded = loaded
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=asyncio.run, args=(self._serve(),), daemon=True)

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        self.loop = asyncio.get_running_loop()
        async with ChatServer(self.settings, load=lambda: self.loaded) as server:
            await server.wait_ready()
            self.server = server
            self._ready.set()
            await self._stop.wait()

    def __enter__(self) -> ChatServer:
        self._thread.start()
        assert self._ready.wait(60)
        return self.server

    def __exit__(self, *exc_info) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


class WellBehaved(threading.Thread):
    """Chats on its own connection the whole time; every turn must complete."""

    def __init__(self, url: str):
        super().__init__(daemon=True)
        self.url, self.turns, self.problems = url, 0, []
        self.stop = threading.Event()

    def run(self) -> None:
        with connect_sync(self.url) as websocket:
            websocket.send(json.dumps({"type": "session.open"}))
            session_id = json.loads(websocket.recv(30))["session_id"]
            while not self.stop.is_set():
                websocket.send(json.dumps({"type": "chat.request", "session_id": session_id,
                                           "content": f"turn {self.turns}", "params": {"max_new_tokens": 3}}))
                while (message := json.loads(websocket.recv(30)))["type"] == "chat.delta":
                    pass
                if message["type"] != "chat.done":
                    self.problems.append(message)
                self.turns += 1


def exchange(websocket, frame: str | bytes) -> list[dict]:
    """Send one frame, then the sentinel; every reply up to the sentinel's must be a valid message."""
    websocket.send(frame)
    websocket.send(SENTINEL)
    replies = []
    while True:
        message = json.loads(websocket.recv(30))
        assert message.get("type") in SERVER_TYPES, message
        replies.append(message)
        if message.get("turn_id") == "sentinel":
            return replies


@pytest.fixture
def errors_logged(caplog):
    caplog.set_level(logging.ERROR)
    yield caplog
    assert [record.getMessage() for record in caplog.records if record.levelno >= logging.ERROR] == []


def test_protocol_fuzzing_floods_and_malformed_frames(tiny, errors_logged):
    with ServerThread(tiny, max_message_bytes=64 * 1024) as server:
        bystander = WellBehaved(server.url)
        bystander.start()
        with connect_sync(server.url) as websocket:

            @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
            @given(frame=frames)
            def fuzz(frame):
                replies = exchange(websocket, frame)
                if isinstance(frame, bytes):
                    assert replies[0]["code"] == "bad_request" and "binary" in replies[0]["message"]

            fuzz()
            # A flood: 500 bad messages without reading; every one is answered, in order.
            for index in range(500):
                websocket.send(json.dumps({"type": "chat.cancel", "turn_id": f"flood-{index}"}))
            answered = [json.loads(websocket.recv(30))["turn_id"] for _ in range(500)]
            assert answered == [f"flood-{index}" for index in range(500)]

        with connect_sync(server.url) as invalid:  # invalid UTF-8 in a text frame
            invalid.send(b"\xff\xfe{\"type\":", text=True)
            with pytest.raises(ConnectionClosed) as closed:
                invalid.recv(30)
            assert closed.value.rcvd.code == 1007
        with connect_sync(server.url, max_size=None) as huge:
            huge.send("x" * (64 * 1024 + 1))
            with pytest.raises(ConnectionClosed) as closed:
                huge.recv(30)
            assert closed.value.rcvd.code == 1009
        bystander.stop.set()
        bystander.join(60)
    assert bystander.problems == [] and bystander.turns > 0


def resident_kb() -> int:
    return int(next(line for line in Path("/proc/self/status").read_text().splitlines()
                    if line.startswith("VmRSS")).split()[1])


async def test_500_idle_connections_beside_16_chatting_sessions(tiny):
    settings = Settings(port=0, device_cache_mb=0.5, host_cache_mb=1.0)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        before = resident_kb()
        idle = await asyncio.gather(*(connect(server.url, ping_interval=0.5, ping_timeout=10) for _ in range(500)))

        async def customer(index: int) -> list[str]:
            async with ChatClient(await connect(server.url)) as client:
                session_id = (await client.open_session(system=f"Customer {index % 4}")).session_id
                sources = []
                for turn in range(4):
                    done = await (await client.chat(session_id, f"customer {index} turn {turn}",
                                                    max_new_tokens=12)).result()
                    sources.append(done.cache.source)
                return sources

        chats = await asyncio.gather(*(customer(index) for index in range(16)))
        await asyncio.sleep(1.5)  # a few keepalive rounds on every idle connection
        assert all(websocket.state.name == "OPEN" for websocket in idle)
        stats = server.stats.snapshot(server.live_state())
        for websocket in idle:
            await websocket.close()
    assert all(len(sources) == 4 for sources in chats)
    tiers = stats["now"]["tiers"]
    assert tiers["device"]["bytes"] <= tiers["device"]["budget_bytes"]
    assert tiers["host"]["bytes"] <= tiers["host"]["budget_bytes"]
    assert stats["windows"]["1m"]["errors"] == {} and stats["windows"]["1m"]["turns"] == 64
    assert resident_kb() - before < 300_000  # 516 connections and 64 turns: well under 300 MB


KEYS = ["sk-churn-a-0000000000000000", "sk-churn-b-1111111111111111"]


async def converse(url: str, key: str, index: int) -> list[list[str]]:
    async with await ChatClient.connect(url, api_key=key) as client:
        session_id = (await client.open_session(system=f"You serve customer {index}.")).session_id
        replies = []
        for turn in range(3):
            stream = await client.chat(session_id, f"I am customer {index}; this is my message {turn}.",
                                       max_new_tokens=8)
            await stream.result()
            replies.append(stream.deltas)
        return replies


async def test_32_sessions_of_two_keys_under_churn_equal_their_solo_runs(tiny):
    churn = Settings(port=0, api_key=KEYS, device_cache_mb=0.25, host_cache_mb=0.5)
    solo = Settings(port=0, api_key=KEYS, session_cache=False)
    async with ChatServer(churn, load=lambda: tiny) as busy, ChatServer(solo, load=lambda: tiny) as alone:
        await busy.wait_ready()
        await alone.wait_ready()
        together = await asyncio.gather(*(converse(busy.url, KEYS[i % 2], i) for i in range(32)))
        expected = [await converse(alone.url, KEYS[i % 2], i) for i in range(32)]
        counters = await asyncio.wrap_future(busy.engine.call(lambda store: dict(store.counters)))
    assert together == expected
    assert counters.get("device_evictions", 0) > 0 and counters.get("host_evictions", 0) > 0  # real churn
