"""Context overflow: the system prompt stays, the oldest whole turns go, the cache is rebuilt once
(`truncated`) and reused after; replies equal an uncached server's token for token."""

from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient, ChatError
from chatd.config import Settings
from tests.support import TINY_CONTEXT, beside_a_reference

SYSTEM = "You are the support desk of a bicycle shop."


async def test_oldest_turns_are_dropped_and_the_window_is_reused(tiny):
    async with beside_a_reference(tiny, Settings(port=0), Settings(port=0, session_cache=False)) as (_, a, b):
        on_a = (await a.open_session(system=SYSTEM)).session_id
        on_b = (await b.open_session(system=SYSTEM)).session_id
        done = []
        for index in range(10):
            question = f"Question {index}: " + "my gears slip when I pedal hard uphill " * 6
            turn_a = await a.chat(on_a, question, max_new_tokens=16)
            turn_b = await b.chat(on_b, question, max_new_tokens=16)
            result_a, result_b = await turn_a.result(), await turn_b.result()
            assert turn_a.deltas == turn_b.deltas and result_a.content == result_b.content, index
            assert result_a.dropped_turns == result_b.dropped_turns
            assert result_a.usage.prompt_tokens + 16 <= TINY_CONTEXT
            done.append(result_a)
        history = (await a.open_session(session_id=on_a)).history
    dropped = [d.dropped_turns for d in done]
    assert dropped[0] == 0 and dropped[-1] > 0 and dropped == sorted(dropped), dropped
    moves = [i for i in range(1, len(done)) if dropped[i] > dropped[i - 1]]
    assert moves, dropped
    for i in moves:  # the window moved: rebuilt once ...
        assert done[i].cache.source == "miss" and done[i].cache.miss_reason == "truncated"
    for i in range(1, len(done)):  # ... and reused on every other turn
        if i not in moves:
            assert done[i].cache.source == "device" and done[i].usage.cached_tokens > 0, i
    assert len(history) == 2 * len(done)  # the session keeps every turn; only the prompt leaves some out


async def test_a_message_too_long_on_its_own_is_too_long(tiny):
    async with ChatServer(Settings(port=0), load=lambda: tiny) as server:
        await server.wait_ready()
        async with ChatClient(await connect(server.url)) as client:
            session_id = (await client.open_session(system=SYSTEM)).session_id
            await (await client.chat(session_id, "Hello!", max_new_tokens=4)).result()
            try:
                await (await client.chat(session_id, "spokes " * TINY_CONTEXT, max_new_tokens=4)).result()
                raise AssertionError("a message longer than the context was accepted")
            except ChatError as error:
                assert error.code == "too_long" and "context" in error.message
            after = await (await client.chat(session_id, "Still there?", max_new_tokens=4)).result()
            assert after.cache.source == "device" and after.dropped_turns == 0
