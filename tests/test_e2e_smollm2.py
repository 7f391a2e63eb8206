"""End to end with the real SmolLM2-135M-Instruct over real websockets: a session-cached server
must answer exactly like a server that prefills the whole conversation every turn."""

from websockets.asyncio.client import connect

from chatd.client import ChatClient
from chatd.config import Settings
from chatd.server import ChatServer

SYSTEM = "You are a friendly customer-service agent for Northwind Internet. Answer briefly."
TURNS = [
    "Hi, my internet has been down since this morning.",
    "I already restarted the router twice.",
    "The light on the router is blinking orange.",
    "Okay, I pressed the reset button. What should I check next?",
    "It works again now, thank you! Can you also tell me my data plan?",
]


async def test_five_turns_reuse_the_device_cache_and_match_a_cacheless_server(smollm2):
    async with ChatServer(Settings(port=0), load=lambda: smollm2) as cached, \
            ChatServer(Settings(port=0, session_cache=False), load=lambda: smollm2) as uncached:
        await cached.wait_ready()
        await uncached.wait_ready()
        async with ChatClient(await connect(cached.url)) as with_cache, \
                ChatClient(await connect(uncached.url)) as without_cache:
            session_a = (await with_cache.open_session(system=SYSTEM)).session_id
            session_b = (await without_cache.open_session(system=SYSTEM)).session_id
            for index, content in enumerate(TURNS):
                hit = await with_cache.chat(session_a, content, max_new_tokens=40)
                miss = await without_cache.chat(session_b, content, max_new_tokens=40)
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
