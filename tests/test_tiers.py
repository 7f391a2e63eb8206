"""The cache tiers seen from the engine and the server, with the tiny model: a turn that finds its
cache offloaded, dropped or shared must answer exactly like a turn that never lost it."""

import asyncio
import threading
import time

import torch
from torch import nn
from websockets.asyncio.client import connect

from cache_store import kv_bytes_per_token
from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.engine.turn import TurnFailed
from chatd.model.loader import LoadedModel
from sessions import Session
from tests.support import beside_a_reference, kv_budget_mb, run_turn, running_engine
from tests.test_e2e_smollm2 import CUSTOMERS, SYSTEM, TURNS

QUESTIONS = ["My parcel is late.", "It was sent on Monday.", "The tracking number is 8812.", "Thanks!"]


def test_interleaved_sessions_restored_from_the_host_answer_like_an_unlimited_engine(tiny):
    # Before each turn every idle cache goes to the host tier: each turn of one session restores its cache.
    with running_engine(tiny) as small, running_engine(tiny) as unlimited:
        sessions = {name: (Session(name, system="Be brief."), Session(name, system="Be brief."))
                    for name in ("a", "b")}
        for index, question in enumerate(QUESTIONS):
            for name, (limited, reference) in sessions.items():
                small.offload_idle()
                got, _ = run_turn(small, limited, question, max_new_tokens=12)
                expected, _ = run_turn(unlimited, reference, question, max_new_tokens=12)
                assert got.token_ids == expected.token_ids, f"turn {index + 1} of {name}"
                if index > 0:
                    assert (got.cache_source, got.cached_tokens) == ("host", expected.cached_tokens)
                    assert expected.cache_source == "device"
        stats = small.cache.stats()
        assert stats["restores"] == 6 and stats["device_bytes"] <= stats["device_budget_bytes"]


def test_a_cache_dropped_from_a_full_host_tier_is_recomputed_with_the_same_reply(tiny):
    with running_engine(tiny, host_cache_mb=kv_budget_mb(tiny, 10)) as small, running_engine(tiny) as unlimited:
        a, b, a_ref, b_ref = Session("a"), Session("b"), Session("a"), Session("b")
        for session, reference in ((a, a_ref), (b, b_ref)):
            run_turn(small, session, QUESTIONS[0], max_new_tokens=10)
            run_turn(unlimited, reference, QUESTIONS[0], max_new_tokens=10)
        small.offload_idle()  # neither fits a host tier of 10 tokens: both are dropped
        got, _ = run_turn(small, a, QUESTIONS[1], max_new_tokens=10)
        expected, _ = run_turn(unlimited, a_ref, QUESTIONS[1], max_new_tokens=10)
        assert (got.cache_source, got.miss_reason, got.cached_tokens) == ("miss", "evicted", 0)
        assert got.token_ids == expected.token_ids
        assert small.cache.counters["host_evictions"] >= 1


def test_sessions_with_the_same_system_prompt_share_its_prefill(tiny):
    system = "You are the support desk of Example Air. Be polite and precise."
    with running_engine(tiny) as engine, running_engine(tiny, session_cache=False) as reference:
        first, _ = run_turn(engine, Session("a", system=system), "Hello", max_new_tokens=8)
        second, _ = run_turn(engine, Session("b", system=system), "Where is gate 12?", max_new_tokens=8)
        expected, _ = run_turn(reference, Session("c", system=system), "Where is gate 12?", max_new_tokens=8)
        other, _ = run_turn(engine, Session("d", system="Another prompt, for the lost luggage desk of Example Air."),
                            "Hi", max_new_tokens=8)
        assert (first.cache_source, first.miss_reason) == ("miss", "new")
        assert second.cache_source == "prefix" and 10 < second.cached_tokens < second.prompt_tokens
        assert second.token_ids == expected.token_ids
        assert other.cache_source == "miss"
        assert engine.cache.stats()["prefixes"] == 0, "short prompts are copied from their first session"


def test_an_idle_disconnected_cache_expires_after_the_ttl(tiny):
    with running_engine(tiny, session_ttl_s=0.3) as engine:
        session = Session("s")
        run_turn(engine, session, "hello", max_new_tokens=4)
        deadline = time.monotonic() + 10
        while "s" in engine.cache.device and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "s" not in engine.cache.device
        again, _ = run_turn(engine, session, "still there?", max_new_tokens=4)
        assert (again.cache_source, again.miss_reason) == ("miss", "evicted")


class OutOfMemoryOnce(nn.Module):
    """Wraps a model; chosen calls first half-write the cache (as a real OOM in a middle layer
    would) and then raise CUDA's out-of-memory error. CPU runs cannot produce the real one."""

    def __init__(self, model: nn.Module, failing_calls: set[int]):
        super().__init__()
        self.inner, self.failing_calls, self.calls = model, failing_calls, 0
        self.config, self.dtype = model.config, model.dtype

    def forward(self, input_ids, cache, **kwargs):
        self.calls += 1
        if self.calls in self.failing_calls:
            layer = cache.layers[0]
            if layer.is_initialized:
                layer.length += 1  # as if the first layer had stored the new token
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (injected)")
        return self.inner(input_ids=input_ids, cache=cache, **kwargs)


def test_out_of_memory_offloads_idle_caches_and_retries_once(tiny):
    failing = OutOfMemoryOnce(tiny.model, failing_calls=set())
    flaky = LoadedModel("flaky", failing, tiny.tokenizer, tiny.device, tiny.stop_token_ids)
    with running_engine(flaky) as engine, running_engine(tiny) as reference:
        other, session, twin = Session("other"), Session("s"), Session("s")
        run_turn(engine, other, "hello", max_new_tokens=4)
        run_turn(engine, session, QUESTIONS[0], max_new_tokens=6)
        run_turn(reference, twin, QUESTIONS[0], max_new_tokens=6)
        failing.failing_calls = {failing.calls + 1, failing.calls + 4}  # the prefill and a decode step
        got, _ = run_turn(engine, session, QUESTIONS[1], max_new_tokens=6)
        expected, _ = run_turn(reference, twin, QUESTIONS[1], max_new_tokens=6)
        assert got.token_ids == expected.token_ids and got.cache_source == "device"
        assert "other" in engine.cache.host, "the idle cache was offloaded to make room"
        assert engine.cache.device.get("s").is_consistent()

        failing.failing_calls = {failing.calls + 1, failing.calls + 2}  # fails again on the retry
        failed, _ = run_turn(engine, session, QUESTIONS[2], max_new_tokens=6)
        assert isinstance(failed, TurnFailed) and failed.code == "internal" and "OutOfMemory" in failed.message
        recovered, _ = run_turn(engine, session, QUESTIONS[2], max_new_tokens=6)
        assert recovered.cache_source == "miss" and recovered.completion_tokens == 6


async def test_typing_restores_the_cache_before_the_message_arrives(tiny):
    async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            a = (await client.open_session()).session_id
            b = (await client.open_session()).session_id
            await (await client.chat(a, QUESTIONS[0], max_new_tokens=8)).result()
            await (await client.chat(b, QUESTIONS[0], max_new_tokens=8)).result()
            assert await asyncio.wrap_future(server.engine.call(lambda store: store.evict_idle())) >= 2
            assert a in server.engine.cache.host
            await client._send({"type": "typing", "session_id": a})
            await client._send({"type": "typing", "session_id": "no-such-session"})  # a hint: no error
            for _ in range(100):
                if a in server.engine.cache.device:
                    break
                await asyncio.sleep(0.02)
            done = await (await client.chat(a, QUESTIONS[1], max_new_tokens=8)).result()
            assert done.cache.source == "device" and done.usage.cached_tokens > 0
            assert client._replies.empty(), "typing is never answered"


def test_cache_bytes_follow_the_gqa_formula_and_match_the_tensors(tiny, smollm2_dir):
    from transformers import AutoConfig

    smollm2_config = AutoConfig.from_pretrained(smollm2_dir)
    assert kv_bytes_per_token(smollm2_config, torch.float16) == 2 * 30 * 3 * 64 * 2 == 23_040
    assert kv_bytes_per_token(smollm2_config, torch.float32) == 46_080
    with running_engine(tiny) as engine:
        session = Session("s")
        assert engine.arena.bytes_per_token == kv_bytes_per_token(tiny.model.config, torch.float64)
        for question in QUESTIONS[:2]:
            run_turn(engine, session, question, max_new_tokens=5)
            entry = engine.cache.device.get("s")
            real = sum(keys.nbytes + values.nbytes for keys, values in entry.tensors())
            assert real == entry.num_tokens * engine.arena.bytes_per_token
            assert entry.nbytes() == entry.cache.region.capacity * engine.arena.bytes_per_token >= real


def test_a_turn_that_does_not_fit_beside_a_running_one_waits_for_it(tiny):
    """Two new sessions at once, a device arena that holds what one turn may reach but not two: the
    second waits for the first to finish rather than overrun the budget, and both answer correctly."""
    with running_engine(tiny, device_cache_mb=kv_budget_mb(tiny, 200)) as engine, \
            running_engine(tiny) as reference:
        sessions = [Session("first"), Session("second")]
        results = [None, None]
        threads = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, run_turn(engine, sessions[i], QUESTIONS[i], max_new_tokens=100)[0])) for i in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(120)
        for session, result, question in zip(sessions, results, QUESTIONS, strict=False):
            expected, _ = run_turn(reference, Session(session.session_id), question, max_new_tokens=100)
            assert result.token_ids == expected.token_ids
        assert set(engine.counts.batch_sizes) == {1}, "the second turn never ran beside the first"
        assert engine.cache.device.used_bytes() <= engine.cache.device.budget_bytes


async def test_interleaved_conversations_under_a_small_device_budget_match_an_unlimited_server(tiny):
    """Four customers take turns; the device's KV arena holds 176 tokens (the shared system prompt and about
    two conversations after their first turn, one after their second), so a customer returning after three
    others always finds its cache offloaded to the host tier, and it must be restored exactly."""
    async with beside_a_reference(tiny, Settings(port=0, device_cache_mb=kv_budget_mb(tiny, 176)), Settings(port=0)) \
            as (small, limited_client, reference_client):
        sessions = {}
        for name in CUSTOMERS:
            sessions[name] = ((await limited_client.open_session(system=SYSTEM)).session_id,
                              (await reference_client.open_session(system=SYSTEM)).session_id)
        for round_index in range(3):
            for name, questions in CUSTOMERS.items():
                limited_id, reference_id = sessions[name]
                got = await limited_client.chat(limited_id, questions[round_index], max_new_tokens=24)
                expected = await reference_client.chat(reference_id, questions[round_index], max_new_tokens=24)
                got_done, expected_done = await got.result(), await expected.result()
                assert got.deltas == expected.deltas, f"{name}, turn {round_index + 1}"
                if round_index > 0:  # (in the first round the small budget may have evicted the shared prefix)
                    assert (got_done.cache.source, expected_done.cache.source) == ("host", "device")
                    assert got_done.usage.cached_tokens == expected_done.usage.cached_tokens
        stats = small.engine.cache.stats()
        assert stats["device_bytes"] <= stats["device_budget_bytes"]
        assert stats["restores"] == 8


async def test_a_conversation_longer_than_the_arena_is_shown_its_whole_history(tiny):
    """The KV arena holds 272 tokens; this conversation outgrows it (374 tokens after five turns of up to
    48). The budget must never change what the model is shown: every turn's prompt and reply equal an
    unlimited server's, and the turns longer than the arena run in a cache outside it (counted)."""
    async with beside_a_reference(tiny, Settings(port=0, device_cache_mb=kv_budget_mb(tiny, 272)), Settings(port=0)) \
            as (small, limited_client, reference_client):
        arena_tokens = small.engine.arena.tokens
        limited_id = (await limited_client.open_session(system=SYSTEM)).session_id
        reference_id = (await reference_client.open_session(system=SYSTEM)).session_id
        for index, content in enumerate(TURNS):
            got = await limited_client.chat(limited_id, content, max_new_tokens=48)
            expected = await reference_client.chat(reference_id, content, max_new_tokens=48)
            got_done, expected_done = await got.result(), await expected.result()
            assert got.deltas == expected.deltas, f"turn {index + 1}"
            assert got_done.usage.prompt_tokens == expected_done.usage.prompt_tokens, f"turn {index + 1}"
            assert got_done.cache.miss_reason != "truncated"
        total = expected_done.usage.prompt_tokens + expected_done.usage.completion_tokens
        assert total > arena_tokens, f"the conversation ({total} tokens) never outgrew the arena ({arena_tokens})"
        assert small.engine.counts.outside_arena_turns >= 1
        stats = small.engine.cache.stats()
        assert stats["device_bytes"] <= stats["device_budget_bytes"]
