"""Engine supervision, through a real server and real websocket clients with the tiny model: a fault
at any engine stage fails only the turns it touched (internal, cache dropped on this worker, the next
turn recomputes the same reply), and a fatal fault answers unavailable, turns /healthz to 503 and makes
`chatd serve` exit non-zero."""

import asyncio
import json
import os
import re
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
from websockets.asyncio.client import connect

from cache_store import CacheStore
from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings

SYSTEM = "You are a support agent."
FIRST = {"a": "My parcel never arrived.", "b": "I need a copy of my invoice."}
SECOND = {"a": "It was order 1234, sent last week.", "b": "The invoice is for March."}
TOKENS = 12


def post(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


async def arm(server: ChatServer, stage: str, session_id: str | None = None, fatal: bool = False) -> None:
    query = f"stage={stage}" + (f"&session={session_id}" if session_id else "") + ("&fatal=true" if fatal else "")
    status, body = await asyncio.to_thread(post, f"http://127.0.0.1:{server.port}/admin/engine/fault?{query}")
    assert status == 200, body


async def two_turns_each(server: ChatServer) -> dict[str, list[list[str]]]:
    """The deltas of both turns of both conversations, run without faults."""
    async with ChatClient(await connect(server.url)) as client:
        replies = {}
        for name in FIRST:
            session_id = (await client.open_session(system=SYSTEM)).session_id
            replies[name] = []
            for content in (FIRST[name], SECOND[name]):
                turn = await client.chat(session_id, content, max_new_tokens=TOKENS)
                await turn.result()
                replies[name].append(turn.deltas)
        return replies


async def after_first_turns(client: ChatClient) -> dict[str, str]:
    """Both conversations opened and through their first turn, without faults: their session ids."""
    sessions = {name: (await client.open_session(system=SYSTEM)).session_id for name in FIRST}
    for name, session_id in sessions.items():
        await (await client.chat(session_id, FIRST[name], max_new_tokens=TOKENS)).result()
    return sessions


@pytest.fixture(scope="module")
def reference(tiny):
    async def run():
        async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
            await server.wait_ready()
            return await two_turns_each(server)
    return asyncio.run(run())


@pytest.mark.parametrize("stage", ["render", "lookup", "prefill", "sampling", "decode", "write-back"])
async def test_a_fault_at_an_engine_stage_fails_only_its_turn(tiny, reference, stage, caplog):
    async with ChatServer(Settings(port=0, enable_fault_injection=True), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            sessions = await after_first_turns(client)
            await arm(server, stage, sessions["a"])
            faulty = await client.chat(sessions["a"], SECOND["a"], max_new_tokens=TOKENS)
            healthy = await client.chat(sessions["b"], SECOND["b"], max_new_tokens=TOKENS)
            with pytest.raises(ChatError) as failed:
                await faulty.result()
            assert failed.value.code == "internal" and stage in failed.value.message
            assert (await healthy.result()).finish_reason in ("stop", "length")
            assert healthy.deltas == reference["b"][1], "the other turn is untouched"
            assert not await asyncio.wrap_future(server.engine.call(
                lambda store: sessions["a"] in store.device or sessions["a"] in store.host))

            retry = await client.chat(sessions["a"], SECOND["a"], max_new_tokens=TOKENS)
            done = await retry.result()
            # The failed session's cache was dropped: it recomputes its history (from the shared system prompt).
            assert done.cache.source in ("miss", "prefix")
            assert retry.deltas == reference["a"][1]
        assert server.engine.failure is None and server.engine.failures[stage] == 1
        status, _ = await asyncio.to_thread(get, f"http://127.0.0.1:{server.port}/healthz")
        assert status == 200


async def test_a_failed_offload_loses_only_that_cache(tiny, reference):
    async with ChatServer(Settings(port=0, enable_fault_injection=True), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            sessions = await after_first_turns(client)
            await arm(server, "offload", sessions["a"])
            assert await asyncio.wrap_future(server.engine.call(CacheStore.evict_idle)) >= 2
            sources = {}
            for name, session_id in sessions.items():
                turn = await client.chat(session_id, SECOND[name], max_new_tokens=TOKENS)
                sources[name] = (await turn.result()).cache.source
                assert turn.deltas == reference[name][1]
        assert sources["a"] in ("miss", "prefix") and sources["b"] == "host"
        stats = await asyncio.wrap_future(server.engine.call(CacheStore.stats))
        assert stats["offload_failures"] == 1


async def test_a_fatal_fault_answers_unavailable_and_turns_healthz_to_503(tiny):
    async with ChatServer(Settings(port=0, enable_fault_injection=True), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            running = (await client.open_session(system=SYSTEM)).session_id
            waiting = (await client.open_session(system=SYSTEM)).session_id
            await arm(server, "decode", running, fatal=True)
            doomed = await client.chat(running, FIRST["a"], max_new_tokens=TOKENS)
            queued = await client.chat(waiting, FIRST["b"], max_new_tokens=TOKENS)
            for turn in (doomed, queued):
                with pytest.raises(ChatError) as failed:
                    await asyncio.wait_for(turn.result(), 60)
                assert failed.value.code == "unavailable" and failed.value.retryable
            status, body = await asyncio.to_thread(get, f"http://127.0.0.1:{server.port}/healthz")
            assert status == 503 and "engine failed" in body and "fault injected" in body
            later = await client.chat(waiting, FIRST["b"], max_new_tokens=TOKENS)
            with pytest.raises(ChatError, match="unavailable"):
                await asyncio.wait_for(later.result(), 10)
        # Set from the engine thread once it has failed every turn it had: the refusals above may come first.
        await asyncio.wait_for(server.engine_failed.wait(), 10)
        metrics = (await asyncio.to_thread(get, f"http://127.0.0.1:{server.port}/metrics"))[1]
        assert re.search(r'^chatd:engine_up\{model_name="[^"]*"\} 0\.0$', metrics, re.MULTILINE)


async def test_chatd_serve_exits_non_zero_when_its_engine_cannot_go_on(tiny_checkpoint):
    process = subprocess.Popen(
        [sys.executable, "-m", "chatd", "serve", "--model", str(tiny_checkpoint), "--port", "0", "--device", "cpu",
         "--enable-fault-injection", "--log-level", "warning"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        port = int(re.search(r"ws://127\.0\.0\.1:(\d+)/ws", process.stdout.readline()).group(1))
        status, _ = await asyncio.to_thread(post, f"http://127.0.0.1:{port}/admin/engine/fault?stage=prefill&fatal=1")
        assert status == 200
        async with ChatClient(await connect(f"ws://127.0.0.1:{port}/ws")) as client:
            session_id = (await client.open_session()).session_id
            with pytest.raises(ChatError, match="unavailable"):
                await (await client.chat(session_id, "hello", max_new_tokens=4)).result()
        code = await asyncio.to_thread(process.wait, 30)
        assert code != 0
        assert "the engine stopped" in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(10)


async def test_a_grammar_that_raises_fails_its_turn_only_while_another_conversation_streams_on(tiny, reference):
    """The grammar library fails while filling a constrained turn's mask in the middle of its reply, in the steps it
    shares with another turn: that turn alone is answered `internal`, naming the grammar; the other streams on."""
    note = {"type": "object", "properties": {"note": {"type": "string", "minLength": 400}}, "required": ["note"]}
    async with ChatServer(Settings(port=0, enable_fault_injection=True), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            sessions = await after_first_turns(client)
            constrained = (await client.open_session(
                system=SYSTEM, response_format={"type": "json_schema", "schema": note})).session_id
            faulty = await client.chat(constrained, "Leave me a long note.", max_new_tokens=200)
            healthy = await client.chat(sessions["b"], SECOND["b"], max_new_tokens=TOKENS)
            for turn in (faulty, healthy):
                async for _ in turn:  # both are streaming (the note cannot end before 400 characters)
                    break
            await arm(server, "grammar", constrained)
            with pytest.raises(ChatError) as failed:
                await faulty.result()
            assert failed.value.code == "internal" and "grammar" in failed.value.message
            assert (await healthy.result()).finish_reason in ("stop", "length")
            assert healthy.deltas == reference["b"][1], "the other turn streamed on, untouched"
            retry = await client.chat(constrained, "Leave me a short note.", max_new_tokens=TOKENS)
            assert (await retry.result()).finish_reason == "length", "the next turn of that session is served"
        assert server.engine.failure is None and server.engine.failures["grammar"] == 1


async def test_a_restore_that_fails_after_its_copy_began_leaks_nothing_from_the_host_tier(tiny, reference):
    """The copy of a host cache back to the device fails once it has begun: the turn is answered `internal`, the
    host tier holds no memory for it beyond what its copies hold (the chain was put back, then dropped with the
    failed turn's cache), and the same question recomputes the same reply."""
    def leaked(store: CacheStore) -> int:
        held = {id(piece.buffer): piece.buffer.numel() for key in store.host.keys()
                for piece in store.host.get(key).pieces() if piece.buffer is not None}
        return store.host.pool.held_bytes - store.host.pool.free_bytes - sum(held.values())

    async with ChatServer(Settings(port=0, enable_fault_injection=True), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            sessions = await after_first_turns(client)
            assert await asyncio.wrap_future(server.engine.call(CacheStore.evict_idle)) >= 2
            host_bytes = await asyncio.wrap_future(server.engine.call(lambda store: store.host.used_bytes()))
            await arm(server, "restore", sessions["a"])
            faulty = await client.chat(sessions["a"], SECOND["a"], max_new_tokens=TOKENS)
            with pytest.raises(ChatError) as failed:
                await faulty.result()
            assert failed.value.code == "internal" and "lookup" in failed.value.message
            assert await asyncio.wrap_future(server.engine.call(leaked)) == 0
            assert await asyncio.wrap_future(server.engine.call(lambda store: store.host.used_bytes())) == host_bytes
            for name, session_id in sessions.items():
                turn = await client.chat(session_id, SECOND[name], max_new_tokens=TOKENS)
                done = await turn.result()
                assert turn.deltas == reference[name][1]
                expected = "host" if name == "b" else "prefix" if done.usage.cached_tokens else "miss"
                assert done.cache.source == expected
        assert await asyncio.wrap_future(server.engine.call(leaked)) == 0
