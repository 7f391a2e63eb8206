"""End to end with the real SmolLM2-135M-Instruct over real websockets: a session-cached server
must answer exactly like a server that prefills the whole conversation every turn."""

from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from tests.support import beside_a_reference, kv_budget_mb

SYSTEM = "You are a friendly customer-service agent for Northwind Internet. Answer briefly."
TURNS = [
    "Hi, my internet has been down since this morning.",
    "I already restarted the router twice.",
    "The light on the router is blinking orange.",
    "Okay, I pressed the reset button. What should I check next?",
    "It works again now, thank you! Can you also tell me my data plan?",
]


async def test_five_turns_reuse_the_device_cache_and_match_a_cacheless_server(smollm2):
    async with beside_a_reference(smollm2, Settings(port=0), Settings(port=0, session_cache=False)) as \
            (_, with_cache, without_cache):
        session_a = (await with_cache.open_session(system=SYSTEM)).session_id
        session_b = (await without_cache.open_session(system=SYSTEM)).session_id
        for index, content in enumerate(TURNS):
            hit = await with_cache.chat(session_a, content, max_new_tokens=24)
            miss = await without_cache.chat(session_b, content, max_new_tokens=24)
            hit_done, miss_done = await hit.result(), await miss.result()
            # Token by token: one delta per released piece, the same pieces, the same count.
            assert hit.deltas == miss.deltas, f"turn {index + 1}"
            assert hit_done.content == miss_done.content
            assert hit_done.usage.completion_tokens == miss_done.usage.completion_tokens
            assert hit_done.usage.prompt_tokens == miss_done.usage.prompt_tokens
            assert miss_done.cache.source == "miss" and miss_done.usage.cached_tokens == 0
            if index == 0:
                assert hit_done.cache.source == "miss" and hit_done.cache.miss_reason == "new"
            else:
                assert hit_done.cache.source == "device", f"turn {index + 1}"
                assert hit_done.usage.cached_tokens > 0
                assert hit_done.usage.prompt_tokens - hit_done.usage.cached_tokens < 40


CUSTOMERS = {
    "billing": ["I was charged twice this month.", "The second charge is 29.99.", "Please refund it."],
    "outage": ["My internet is down.", "The router light is red.", "I restarted it, still red."],
    "moving": ["I am moving house next month.", "The new address is 4 Elm Road.", "Can I keep my number?"],
    "upgrade": ["I want faster internet.", "What plans do you have?", "How much is the fastest one?"],
}


async def test_an_int8_host_tier_keeps_every_conversation_where_full_precision_drops_some(smollm2):
    """The same four interleaved customers, with a device budget of about one conversation and a host
    budget of two full-precision caches: at full precision the host tier must drop caches (recomputed);
    in int8 it keeps all four, so every returning turn restores from the host tier (or was never evicted), and
    says so."""
    device_mb, host_mb = kv_budget_mb(smollm2, 200), kv_budget_mb(smollm2, 2 * 160)
    results = {}
    for kv_dtype in ("same", "int8"):
        settings = Settings(port=0, device_cache_mb=device_mb, host_cache_mb=host_mb, host_kv_dtype=kv_dtype)
        async with ChatServer(settings, load=lambda: smollm2) as server:
            await server.wait_ready()
            async with ChatClient(await connect(server.url)) as client:
                sessions = {name: (await client.open_session(system=SYSTEM)).session_id for name in CUSTOMERS}
                results[kv_dtype] = [await (await client.chat(sessions[name], questions[turn], max_new_tokens=16))
                                     .result() for turn in range(3) for name, questions in CUSTOMERS.items()]
    later = {kv_dtype: done[len(CUSTOMERS):] for kv_dtype, done in results.items()}  # turns 2 and 3
    # (the first customer prefilled the short system prompt, which the others copy from its cache: while they
    # start, it stays on the device)
    int8_later = [(d.cache.source, d.cache.quantized) for d in later["int8"]]
    assert all(source in ("host", "device") for source, _ in int8_later), int8_later
    assert int8_later.count(("host", "int8")) >= len(int8_later) - 1, int8_later
    exact_sources = [(d.cache.source, d.cache.miss_reason) for d in later["same"]]
    assert ("miss", "evicted") in exact_sources and all(d.cache.quantized is None for d in later["same"])
    agreement = sum(a.content == b.content for a, b in zip(results["same"], results["int8"], strict=True))
    print(f"int8 host tier: {agreement} of {len(results['int8'])} replies identical to full precision")
    assert all(d.content and d.usage.completion_tokens > 0 for d in results["int8"])
