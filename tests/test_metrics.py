"""/metrics and /v1/stats after a scripted run: every counter moves by exactly what the run did."""

import asyncio
import json
import urllib.request
from collections import Counter

import pytest
from prometheus_client.parser import text_string_to_metric_families
from websockets.asyncio.client import connect

from cache_store import CacheStore
from chatd.api.server import ChatServer
from chatd.api.websocket.protocol import ChatDone
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings

MODEL = "tiny-test"


def get(url: str) -> tuple[int, str, str]:
    with urllib.request.urlopen(url, timeout=30) as response:
        return response.status, response.headers["Content-Type"], response.read().decode()


def post(url: str) -> int:
    with urllib.request.urlopen(urllib.request.Request(url, method="POST"), timeout=30) as response:
        return response.status


async def scrape(server: ChatServer) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics, keyed by name and labels (model_name checked and left out)."""
    status, content_type, text = await asyncio.to_thread(get, f"http://127.0.0.1:{server.port}/metrics")
    assert status == 200 and content_type.startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = dict(sample.labels)
            assert labels.pop("model_name") == MODEL
            samples[sample.name, frozenset(labels.items())] = sample.value
    return samples


def moved(before: dict, after: dict, name: str, **labels) -> float:
    key = (name, frozenset(labels.items()))
    assert key in after, f"{name}{labels} is not exported"
    return after[key] - before.get(key, 0.0)


async def test_metrics_and_stats_move_by_exactly_what_the_run_did(tiny):
    # Every switch between A and B offloads the other one (the engine runs the offload before the turn).
    settings = Settings(port=0, model=MODEL, enable_fault_injection=True, verify_sample_rate=0.0,
                        speculation_books_mb=1.5)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        before = await scrape(server)
        results: list[ChatDone] = []
        async with ChatClient(await connect(server.url)) as client:
            a = (await client.open_session()).session_id
            b = (await client.open_session()).session_id
            for session_id, text in [(a, "Hello, my order is late."), (b, "I need a refund."),
                                     (a, "It was order 1234."), (b, "The refund is for shoes.")]:
                server.engine.offload_idle()
                results.append(await (await client.chat(session_id, text, max_new_tokens=8)).result())
            base = f"http://127.0.0.1:{server.port}/admin/sessions/{a}/corrupt?kind=bitflip&tier=host"
            assert await asyncio.to_thread(post, base) == 200
            server.engine.offload_idle()
            results.append(await (await client.chat(a, "Any news?", max_new_tokens=8)).result())
            server.engine.offload_idle()
            turn = await client.chat(b, "Tell me a long story.", max_new_tokens=200)
            async for _ in turn:
                await client.cancel(turn.turn_id)
                break
            results.append(await turn.result())
            with pytest.raises(ChatError, match="unknown_session"):
                await (await client.chat("no-such-session", "hi")).result()
            async with connect(server.url) as raw:
                await raw.send("{not json")
                assert json.loads(await raw.recv())["code"] == "bad_request"
            after = await scrape(server)
            store_stats = await asyncio.wrap_future(server.engine.call(CacheStore.stats))
            stats = json.loads((await asyncio.to_thread(get, f"http://127.0.0.1:{server.port}/v1/stats"))[2])

    sources = [r.cache.source for r in results]
    # The damaged host copy of A's third turn is the second of a chain (A was restored for that turn): the fifth
    # turn reuses the first copy and recomputes the rest, and says what failed.
    assert sources == ["miss", "miss", "host", "host", "host", "host"], sources
    assert results[4].cache.cleared == ["checksum"] and results[4].usage.cached_tokens < results[2].usage.prompt_tokens
    assert results[-1].finish_reason == "cancelled"
    prompt = sum(r.usage.prompt_tokens for r in results)
    generated = sum(r.usage.completion_tokens for r in results)
    assert moved(before, after, "chatd:prompt_tokens_total") == prompt
    assert moved(before, after, "chatd:generation_tokens_total") == generated
    assert moved(before, after, "chatd:prefix_cache_queries_total") == prompt
    assert moved(before, after, "chatd:prefix_cache_hits_total") == sum(r.usage.cached_tokens for r in results)
    for source in ("device", "host", "remote", "prefix"):
        expected = sum(r.usage.cached_tokens for r in results if r.cache.source == source)
        assert moved(before, after, "chatd:cached_tokens_total", cache_source=source) == expected
    reasons = Counter(r.cache.miss_reason for r in results if r.cache.source == "miss")
    for reason in ("new", "cold", "evicted", "disabled", "drift", "corrupt", "stale"):
        assert moved(before, after, "chatd:cache_misses_total", reason=reason) == reasons[reason]
    finished = Counter(r.finish_reason for r in results)
    for reason in ("stop", "length", "cancelled"):
        assert moved(before, after, "chatd:request_success_total", finished_reason=reason) == finished[reason]
    assert moved(before, after, "chatd:api_requests_total", api="websocket") == len(results)
    assert moved(before, after, "chatd:api_requests_total", api="openai") == 0
    assert moved(before, after, "chatd:errors_total", code="bad_request") == 1
    assert moved(before, after, "chatd:errors_total", code="unknown_session") == 1
    assert moved(before, after, "chatd:errors_total", code="internal") == 0
    assert moved(before, after, "chatd:cache_corruptions_total", check="checksum") == 1
    assert moved(before, after, "chatd:cache_corruptions_total", check="finite") == 0
    # Every switch between A and B offloads the other conversation: the store's own count is the truth.
    offloads = store_stats["device_evictions"]
    assert offloads >= 5
    assert moved(before, after, "chatd:cache_evictions_total", tier="device") == offloads
    assert moved(before, after, "chatd:cache_evictions_total", tier="host") == 0
    assert moved(before, after, "chatd:cache_offload_seconds_count", tier="host") == offloads
    written = moved(before, after, "chatd:cache_offload_bytes_total", kind="written")
    assert written == store_stats["host_offload_bytes"] > 0
    # Restored turns kept their host copies, so later offloads wrote only what those turns added.
    assert moved(before, after, "chatd:cache_offload_bytes_total", kind="skipped") > 0
    assert moved(before, after, "chatd:cache_restore_seconds_count", tier="host") == sources.count("host")
    assert moved(before, after, "chatd:time_to_first_token_seconds_count") == len(results)
    assert moved(before, after, "chatd:e2e_request_latency_seconds_count") == len(results)
    assert moved(before, after, "chatd:request_queue_time_seconds_count") == len(results)
    assert moved(before, after, "chatd:inter_token_latency_seconds_count") == sum(
        max(0, r.usage.completion_tokens - 1) for r in results)
    # One turn at a time: every decode step advanced one turn, and each sampled a reply token but the first.
    steps = moved(before, after, "chatd:decode_steps_total", batch_size="1")
    assert generated - len(results) <= steps <= generated
    assert not [key for key in after if key[0] == "chatd:decode_steps_total" and key[1] != {("batch_size", "1")}]
    assert after["chatd:num_requests_running", frozenset()] == 0
    assert after["chatd:num_requests_waiting", frozenset()] == 0
    assert 0 <= after["chatd:kv_cache_usage_perc", frozenset({("tier", "device")})] <= 1
    assert 0 < after["chatd:kv_cache_usage_perc", frozenset({("tier", "host")})] < 1
    assert after["chatd:sessions", frozenset({("state", "connected")})] == 2

    one_minute = stats["windows"]["1m"]
    assert stats["model"] == MODEL
    assert one_minute["turns"] == len(results)
    assert one_minute["cache"]["turns_by_source"] == dict(Counter(sources))
    assert one_minute["cache"]["miss_reasons"] == dict(reasons)
    assert one_minute["corruptions"]["checksum"] == 1 and one_minute["evictions"]["device"] == offloads
    assert one_minute["errors"] == {"bad_request": 1, "unknown_session": 1}
    assert one_minute["ttft_ms"]["p50"] > 0 and one_minute["tokens_per_s"] > 0
    assert after["chatd:cache_tier_info", frozenset({("tier", "host"), ("kv_dtype", "float64")})] == 1
    assert after["chatd:cache_tier_sessions", frozenset({("tier", "host")})] == store_stats["host_sessions"]
    tiers = stats["now"]["tiers"]
    assert tiers["host"]["offload"] == {"written_bytes": store_stats["host_offload_bytes"],
                                        "skipped_bytes": store_stats["host_offload_bytes_skipped"]}
    assert tiers["host"]["chunks"] == {"held": store_stats["host_chunk_copies"],
                                       "shared": store_stats["host_chunk_copies_shared"]}
    assert after["chatd:kv_host_chunk_copies", frozenset({("state", "held")})] == store_stats["host_chunk_copies"]
    assert tiers["device"]["kv_dtype"] == tiers["host"]["kv_dtype"] == "float64"
    assert tiers["remote"]["kv_dtype"] is None  # no remote tier
    # (a session restored from the host keeps its host copy while resident: the next offload adds only its turns)
    assert tiers["host"]["bytes"] > 0 and tiers["device"]["sessions"] == 1 and 1 <= tiers["host"]["sessions"] <= 2
    engine = stats["now"]["engine"]  # (this test's process has its own share of the cores: the engine's threads)
    assert engine["threads"] == engine["threads_max"] == after["chatd:engine_threads", frozenset({("state", "max")})]
    assert engine["fetching"] == after["chatd:num_requests_fetching", frozenset()] == 0
    assert after["chatd:spec_books_limit_bytes", frozenset()] == 1.5 * 2**20  # (--speculation-books-mb)
    assert 0 < after["chatd:spec_books_bytes", frozenset()] <= 1.5 * 2**20, "the replies of the run, kept"
    assert stats["now"]["prefix_index"] == {"sessions": 0, "forgotten": 0}  # (no OpenAI client here)
    assert len(stats["series"]["points"]) == 30
    assert stats["series"]["points"][-1]["ttft_ms"]["p50"] is not None


async def test_http_routes(tiny):
    async with ChatServer(Settings(port=0, model=MODEL), load=lambda: tiny) as server:
        await server.wait_ready()
        base = f"http://127.0.0.1:{server.port}"
        for path, kind in [("/", "text/html"), ("/dashboard", "text/html"), ("/web/chat.js", "javascript")]:
            status, content_type, body = await asyncio.to_thread(get, base + path)
            assert status == 200 and kind in content_type and body
        for path in ["/web/../pyproject.toml", "/web/missing.js", "/nope"]:
            with pytest.raises(urllib.error.HTTPError) as refused:
                await asyncio.to_thread(get, base + path)
            assert refused.value.code == 404
