"""Anthropic message threads through the official SDK, against real servers with SmolLM2: the tool runner (threaded,
its default) sends each iteration's new blocks only and reads the conversation from the cache, and ends where the
same runner unthreaded ends on a server without the session cache; every thread error is the SDK's exception with
its `error_code`; the runner recovers from an expired thread by replaying under a new one."""

from __future__ import annotations

import asyncio
import json

import anthropic
import httpx
import httpx2  # (the SDK's own HTTP client package)
import pytest
from anthropic import beta_async_tool

from sessions import StoreUnavailable
from sessions.redis_store import RedisSessionStore
from sessions.threads import RedisThreadStore, ThreadReply
from tests.test_anthropic_api import GREEDY, MODEL, SYSTEM, served

THREADS_BETA = "message-threads-2026-08-12"


@beta_async_tool
async def lookup_order(order_id: str) -> str:
    """Find an order by its id.

    Args:
        order_id: the order's id, such as NW-2231
    """
    return json.dumps({"order_id": order_id, "status": "lost in transit"})


@beta_async_tool
async def open_ticket(summary: str) -> str:
    """Open a support ticket.

    Args:
        summary: what went wrong, in a few words
    """
    return json.dumps({"ticket": "T-88", "summary": summary})


def recording_client(server, sent: list[dict]) -> anthropic.AsyncAnthropic:
    """An SDK client of `server` that keeps the body of every request it sends."""

    async def keep(request: httpx2.Request) -> None:
        sent.append(json.loads(request.content))

    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="unused", max_retries=0,
                                    http_client=httpx2.AsyncClient(event_hooks={"request": [keep]}))


async def run_desk(client: anthropic.AsyncAnthropic, stream: bool, **options) -> list:
    """Three iterations of a support desk's tool runner: a call each time (tool_choice any), its results sent back."""
    runner = client.beta.messages.tool_runner(
        model=MODEL, max_tokens=48, system=SYSTEM, tools=[lookup_order, open_ticket], tool_choice={"type": "any"},
        messages=[{"role": "user", "content": "My order NW-2231 never arrived. Please look it up."}],
        max_iterations=3, stream=stream, extra_body=GREEDY, **options)
    replies = []
    async for item in runner:
        replies.append(await item.get_final_message() if stream else item)
    return replies


def blocks(message) -> list[tuple]:
    return [(block.type, getattr(block, "name", None), getattr(block, "input", None), getattr(block, "text", None))
            for block in message.content]


async def test_the_tool_runner_threads_its_iterations_and_reads_each_from_the_cache(smollm2):
    """Threaded (the runner's default), streamed and not, on a server with the session cache: what the same runner
    gets unthreaded from a server without it."""
    async with served(smollm2) as server, served(smollm2, session_cache=False) as uncached:
        async with recording_client(uncached, []) as reference:
            unthreaded = await run_desk(reference, False, thread=False)
        for stream in (False, True):
            sent: list[dict] = []
            async with recording_client(server, sent) as client:
                threaded = await run_desk(client, stream)
            assert len(threaded) == len(unthreaded) == 3
            assert [blocks(m) for m in threaded] == [blocks(m) for m in unthreaded], f"stream={stream}"
            assert [m.stop_reason for m in threaded] == [m.stop_reason for m in unthreaded]
            _assert_threaded(sent, threaded)


def _assert_threaded(sent: list[dict], threaded: list) -> None:
    """The runner created a thread, then sent only the new blocks, and each reply read the last from the cache."""
    first, *continues = sent
    assert first["thread"] == {"type": "create"} and first["system"] == SYSTEM and len(first["tools"]) == 2
    for request, previous in zip(continues, threaded[:-1], strict=True):
        assert request["thread"] == {"type": "continue", "previous_message_id": previous.id}
        assert "system" not in request and "tools" not in request
        # Only what is new: the results of the previous reply's calls.
        assert [message["role"] for message in request["messages"]] == ["user"]
        assert {block["type"] for block in request["messages"][0]["content"]} == {"tool_result"}
    for previous, message in zip(threaded, threaded[1:], strict=False):
        read, before = message.usage.cache_read_input_tokens, previous.usage
        assert read >= before.input_tokens + before.cache_read_input_tokens + before.cache_creation_input_tokens + \
            before.output_tokens - 1, (message.usage, before)


async def test_thread_errors_are_the_sdks_exceptions_with_their_error_codes(smollm2):
    async with served(smollm2) as server, recording_client(server, []) as client:
        first = await client.beta.messages.create(
            model=MODEL, max_tokens=8, system=SYSTEM, messages=[{"role": "user", "content": "Hello."}],
            thread={"type": "create"}, betas=[THREADS_BETA], extra_body=GREEDY)

        async def continue_from(message_id: str, extra_body: dict = GREEDY, **fields):
            return await client.beta.messages.create(
                model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "And then?"}],
                thread={"type": "continue", "previous_message_id": message_id}, betas=[THREADS_BETA],
                extra_body=extra_body, **fields)

        async def refused(kind, error_code: str, message_id: str, **fields) -> None:
            with pytest.raises(kind) as raised:
                await continue_from(message_id, **fields)
            assert raised.value.body["error"]["details"]["error_code"] == error_code, raised.value.body

        await refused(anthropic.NotFoundError, "thread_not_found", "msg_unknown")
        await refused(anthropic.BadRequestError, "thread_fingerprint_mismatch", first.id, system="Another prompt.")
        await refused(anthropic.NotFoundError, "thread_not_found", first.id, extra_body={**GREEDY, "cache_salt": "b"})
        second = await continue_from(first.id, system=SYSTEM)  # (the thread's own system prompt, sent again)
        await refused(anthropic.BadRequestError, "thread_already_continued", first.id)
        assert (await continue_from(second.id)).usage.cache_read_input_tokens > 0
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            stats = (await http.get("/v1/stats")).json()["now"]["threads"]
    assert stats == {"created": 1, "continued": 2, "not_found": 2}, stats


async def test_an_expired_thread_is_replayed_whole_under_a_new_one(smollm2):
    sent: list[dict] = []
    async with served(smollm2, thread_ttl_s=0.5) as server, recording_client(server, sent) as client:
        runner = client.beta.messages.tool_runner(
            model=MODEL, max_tokens=48, system=SYSTEM, tools=[lookup_order], tool_choice={"type": "any"},
            messages=[{"role": "user", "content": "Where is NW-2231?"}], max_iterations=2, extra_body=GREEDY)
        replies = []
        async for message in runner:
            replies.append(message)
            await asyncio.sleep(1.0)  # past the thread's TTL
    assert len(replies) == 2
    threads = [request["thread"]["type"] for request in sent]
    assert threads == ["create", "continue", "create"], threads  # (not found: the history sent whole again)
    assert len(sent[-1]["messages"]) == 3


CUSTOMER = ["My internet is down since this morning.", "I already restarted the router.", "The light is red.",
            "It is a Northwind X2 router.", "Can a technician come tomorrow?", "Thank you, that is all."]


async def test_six_turns_through_thread_continues_equal_the_whole_conversation_on_a_cacheless_server(smollm2):
    async with served(smollm2) as server, served(smollm2, session_cache=False) as uncached:
        async with recording_client(server, []) as client, recording_client(uncached, []) as reference:
            history, previous = [], None
            for turn, question in enumerate(CUSTOMER):
                asked = {"role": "user", "content": question}
                thread = {"type": "continue", "previous_message_id": previous.id} if previous else {"type": "create"}
                fields = {} if previous else {"system": SYSTEM}
                reply = await client.beta.messages.create(model=MODEL, max_tokens=12, messages=[asked], thread=thread,
                                                          betas=[THREADS_BETA], extra_body=GREEDY, **fields)
                expected = await reference.messages.create(model=MODEL, max_tokens=12, system=SYSTEM,
                                                           messages=[*history, asked], extra_body=GREEDY)
                assert blocks(reply) == blocks(expected), f"turn {turn + 1}"
                if previous is not None:  # only the new message was prefilled
                    assert reply.usage.input_tokens + reply.usage.cache_creation_input_tokens < 40, reply.usage
                history += [asked, {"role": "assistant", "content": [b.model_dump() for b in expected.content]}]
                previous = reply


async def test_a_thread_created_on_one_worker_continues_on_another_and_across_a_restart(tiny, redis_db):
    """Threads live where sessions do: in Redis, any worker continues any thread, and a restart loses none. Each
    reply equals a cacheless server's to the whole conversation so far."""
    questions = ["My internet is down.", "I restarted it.", "The light is still red."]
    replies = []

    async def ask(server, turn: int):
        async with recording_client(server, []) as client:
            thread = {"type": "continue", "previous_message_id": replies[-1].id} if replies else {"type": "create"}
            replies.append(await client.beta.messages.create(
                model=MODEL, max_tokens=6, messages=[{"role": "user", "content": questions[turn]}], thread=thread,
                betas=[THREADS_BETA], extra_body=GREEDY, **({} if replies else {"system": SYSTEM})))

    async with served(tiny, redis_url=redis_db.url) as first, served(tiny, redis_url=redis_db.url) as second:
        await ask(first, 0)
        await ask(second, 1)
    async with served(tiny, redis_url=redis_db.url) as restarted:
        await ask(restarted, 2)
        async with recording_client(restarted, []) as client:  # an id whose braces would split its keys' slots
            with pytest.raises(anthropic.NotFoundError) as unknown:
                await client.beta.messages.create(
                    model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "Hi"}], betas=[THREADS_BETA],
                    thread={"type": "continue", "previous_message_id": "}msg_" + replies[-1].id[4:]})
            assert unknown.value.body["error"]["details"]["error_code"] == "thread_not_found"
    async with served(tiny, session_cache=False) as uncached, recording_client(uncached, []) as reference:
        history = []
        for question, reply in zip(questions, replies, strict=True):
            history.append({"role": "user", "content": question})
            expected = await reference.messages.create(model=MODEL, max_tokens=6, system=SYSTEM, messages=history,
                                                       extra_body=GREEDY)
            assert blocks(reply) == blocks(expected), question
            history.append({"role": "assistant", "content": [b.model_dump() for b in expected.content]})


async def test_a_continue_that_fails_or_is_cut_holds_nothing_and_one_in_flight_is_refused(smollm2):
    async with served(smollm2) as server, recording_client(server, []) as client:
        first = await client.beta.messages.create(
            model=MODEL, max_tokens=8, system=SYSTEM, messages=[{"role": "user", "content": "Hello."}],
            thread={"type": "create"}, betas=[THREADS_BETA], extra_body=GREEDY)
        thread = {"type": "continue", "previous_message_id": first.id}

        def continuing(content, max_tokens: int = 8) -> dict:
            return dict(model=MODEL, max_tokens=max_tokens, messages=[{"role": "user", "content": content}],
                        thread=thread, betas=[THREADS_BETA], extra_body=GREEDY)

        # Refused before any model work (a result for a call nobody made): the reply stays continuable.
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.beta.messages.create(**continuing([{"type": "tool_result", "tool_use_id": "toolu_nobody",
                                                              "content": "42"}]))
        assert "details" not in raised.value.body["error"] and "nobody" in raised.value.body["error"]["message"]
        # A system message (the SDK's tool additions and removals): unsupported, so the SDK goes on unthreaded.
        with pytest.raises(anthropic.BadRequestError) as raised:
            await client.beta.messages.create(**{**continuing("Hi."), "messages": [
                {"role": "system", "content": [{"type": "text", "text": "tools changed"}]},
                {"role": "user", "content": "Hi."}]})
        assert raised.value.body["error"]["details"] == {"error_code": "thread_unsupported_request",
                                                         "unsupported": ["system_message"]}
        # A continue running: another from the same reply is refused; cut before message_stop, it holds nothing.
        async with client.beta.messages.stream(**continuing("Tell me a long story.", max_tokens=64)) as cut:
            async for event in cut:
                if event.type == "content_block_delta":
                    break
            cut_id = cut.current_message_snapshot.id
            with pytest.raises(anthropic.BadRequestError) as raised:
                await client.beta.messages.create(**continuing("Me too."))
            assert raised.value.body["error"]["details"]["error_code"] == "thread_continue_in_flight"
        for _ in range(100):  # (the cut turn is let go as the server sees the client leave)
            try:
                again = await client.beta.messages.create(**continuing("And then?"))
                break
            except anthropic.BadRequestError as error:
                assert error.body["error"]["details"]["error_code"] == "thread_continue_in_flight"
                await asyncio.sleep(0.05)
        assert again.usage.cache_read_input_tokens > 0, "the reply the cut stream continued was continued again"
        with pytest.raises(anthropic.NotFoundError) as raised:
            await client.beta.messages.create(**{**continuing("Hm."), "thread": {
                "type": "continue", "previous_message_id": cut_id}})
        assert raised.value.body["error"]["details"]["error_code"] == "thread_not_found", "a cut reply is not held"


async def test_a_claim_whose_worker_died_ends_with_its_lease_and_a_running_one_is_renewed(redis_db):
    """A continue's claim is leased: one that is renewed (its turn runs) keeps the reply in flight past the lease;
    one that is not (its worker was killed mid-turn) ends with it, and the reply may be continued again."""
    sessions = RedisSessionStore(redis_db.url, retention_s=60)
    store = RedisThreadStore(sessions, ttl_s=60, lease_s=0.4)
    for message_id in ("msg_renewed", "msg_orphaned"):
        await store.put(ThreadReply(message_id, None, None, "session", 1, 2, MODEL, SYSTEM, None))
        assert (await store.claim(message_id, None, None))[0] == "claimed"
    for _ in range(3):
        await asyncio.sleep(0.2)
        await store.renew("msg_renewed")
    assert (await store.claim("msg_renewed", None, None))[0] == "in_flight", "renewed: still running"
    assert (await store.claim("msg_orphaned", None, None))[0] == "claimed", "its worker died: the lease ended"
    await sessions.close()


async def test_a_streamed_reply_that_cannot_be_held_ends_with_an_error_event(tiny):
    """The thread's hold fails (its store cannot be reached): the stream ends with Anthropic's `error` event, which
    the SDK raises, instead of `message_stop` then a broken body; the next create is held as usual."""
    async with served(tiny) as server, recording_client(server, []) as client:
        put = server.threads.store.put

        async def unreachable(reply):
            raise StoreUnavailable("the thread store (Redis) is unreachable")

        server.threads.store.put = unreachable
        kinds = []
        with pytest.raises(anthropic.APIStatusError) as failed:
            async with client.beta.messages.stream(
                    model=MODEL, max_tokens=6, system=SYSTEM, messages=[{"role": "user", "content": "Hello."}],
                    thread={"type": "create"}, betas=[THREADS_BETA], extra_body=GREEDY) as stream:
                async for event in stream:
                    kinds.append(event.type)
        assert "message_delta" in kinds and "message_stop" not in kinds, kinds
        assert "unreachable" in str(failed.value)
        server.threads.store.put = put
        held = await client.beta.messages.create(
            model=MODEL, max_tokens=6, system=SYSTEM, messages=[{"role": "user", "content": "Hello."}],
            thread={"type": "create"}, betas=[THREADS_BETA], extra_body=GREEDY)
        assert (await client.beta.messages.create(
            model=MODEL, max_tokens=6, messages=[{"role": "user", "content": "And then?"}], betas=[THREADS_BETA],
            thread={"type": "continue", "previous_message_id": held.id}, extra_body=GREEDY)).content
