"""Fault injection through a real server (the tiny model: what is checked is the caches, not the
words): every kind of corruption in every tier is caught by its check, the turn still gets exactly the
reply of an uncorrupted run, and the next turn is a normal cache hit again. A healthy run with evictions
reports no corruption at all."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
import pytest_asyncio
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from tests.support import kv_budget_mb

pytestmark = pytest.mark.asyncio(loop_scope="module")

SYSTEM = "You are a support agent for Northwind Internet. Answer briefly."
QUESTIONS = ["My internet is down since this morning.", "The router light is red.", "I restarted it, now green."]
DONOR_QUESTION = "I want to upgrade my plan."
EXPECTED_CHECK = {
    ("nan", "device"): "checksum", ("bitflip", "device"): "checksum", ("truncate", "device"): "length",
    ("shape", "device"): "shape", ("foreign", "device"): "fingerprint", ("tokens", "device"): "fingerprint",
    ("nan", "host"): "checksum", ("bitflip", "host"): "checksum", ("truncate", "host"): "length",
    ("shape", "host"): "shape", ("foreign", "host"): "fingerprint", ("tokens", "host"): "fingerprint",
}


async def start(tiny, **settings) -> ChatServer:
    server = ChatServer(Settings(port=0, **settings), load=lambda: tiny)
    await server.__aenter__()
    await server.wait_ready()
    return server


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def servers(tiny):
    """A server with fault injection and otherwise default settings (the deep check sampled at its
    default rate), and a reference."""
    started = [await start(tiny, enable_fault_injection=True), await start(tiny)]
    yield started
    for server in started:
        await server.__aexit__(None, None, None)


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def reference(servers) -> list[list[str]]:
    """The deltas of each turn of the conversation, never corrupted."""
    async with ChatClient(await connect(servers[1].url)) as client:
        session_id = (await client.open_session(system=SYSTEM)).session_id
        replies = []
        for question in QUESTIONS:
            turn = await client.chat(session_id, question, max_new_tokens=10)
            await turn.result()
            replies.append(turn.deltas)
        return replies


def post(url: str) -> tuple[int, dict]:
    request = urllib.request.Request(url, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


@pytest.mark.parametrize(("kind", "tier"), list(EXPECTED_CHECK))
async def test_a_corrupted_cache_is_caught_cleared_and_recomputed(servers, reference, kind, tier):
    server = servers[0]
    async with ChatClient(await connect(server.url)) as client:
        session_id = (await client.open_session(system=SYSTEM)).session_id
        await (await client.chat(session_id, QUESTIONS[0], max_new_tokens=10)).result()
        if kind == "foreign":
            donor = (await client.open_session(system=SYSTEM)).session_id
            await (await client.chat(donor, DONOR_QUESTION, max_new_tokens=10)).result()
        if tier == "host":
            server.engine.offload_idle()
        status, body = await asyncio.to_thread(
            post, f"http://127.0.0.1:{server.port}/admin/sessions/{session_id}/corrupt?kind={kind}&tier={tier}")
        assert status == 200, body
        assert (body["kind"], body["tier"]) == (kind, tier) and body["done"]

        corrupted = await client.chat(session_id, QUESTIONS[1], max_new_tokens=10)
        done = await corrupted.result()
        assert (done.cache.source, done.cache.miss_reason) == ("miss", "corrupt")
        assert done.cache.cleared == [EXPECTED_CHECK[kind, tier]]
        assert corrupted.deltas == reference[1], "the reply equals the uncorrupted run's, token for token"

        after = await client.chat(session_id, QUESTIONS[2], max_new_tokens=10)
        after_done = await after.result()
        assert after_done.cache.source == "device" and after_done.usage.cached_tokens > 0
        assert after.deltas == reference[2]
    assert server.engine.cache.counters[f"corrupt_{EXPECTED_CHECK[kind, tier]}"] >= 1


async def test_the_admin_endpoint_refuses_what_it_cannot_do(servers):
    healthy, faulty = servers[1], servers[0]
    async with ChatClient(await connect(faulty.url)) as client:
        fresh = (await client.open_session()).session_id
        base = f"http://127.0.0.1:{faulty.port}/admin/sessions"
        assert (await asyncio.to_thread(post, f"{base}/nope/corrupt?kind=nan&tier=device"))[0] == 404
        status, body = await asyncio.to_thread(post, f"{base}/{fresh}/corrupt?kind=nan&tier=host")
        assert status == 404 and "no cache" in body["error"]
        status, body = await asyncio.to_thread(post, f"{base}/{fresh}/corrupt?kind=melt&tier=device")
        assert status == 400 and "bitflip" in body["error"]
    status, body = await asyncio.to_thread(
        post, f"http://127.0.0.1:{healthy.port}/admin/sessions/x/corrupt?kind=nan&tier=device")
    assert status == 403 and "--enable-fault-injection" in body["error"]


async def test_no_check_fires_on_a_healthy_run_with_evictions(tiny):
    """Twenty turns over four sessions, a device arena of about two conversations (so caches go to
    the host tier and back), and a deep check on every reuse: zero corruptions."""
    server = await start(tiny, device_cache_mb=kv_budget_mb(tiny, 256), verify_sample_rate=1.0)
    try:
        async with ChatClient(await connect(server.url)) as client:
            sessions = [(await client.open_session(system=SYSTEM)).session_id for _ in range(4)]
            sources = []
            for turn in range(5):
                for index, session_id in enumerate(sessions):
                    done = await (await client.chat(session_id, f"Question {turn} from customer {index}: "
                                                    + QUESTIONS[turn % 3], max_new_tokens=8)).result()
                    sources.append(done.cache.source)
                    assert done.cache.miss_reason != "corrupt", done.cache
        assert sources.count("host") >= 12
        counters = server.engine.cache.counters
        assert not [name for name in counters if name.startswith("corrupt_")]
        assert len(server.engine.deep_check_distances) >= 12
        assert max(server.engine.deep_check_distances) < 1e-3
    finally:
        await server.__aexit__(None, None, None)
