"""The Anthropic Messages API through the official `anthropic` SDK, against real servers with the real SmolLM2: a
conversation resent whole each turn reads its history from the cache (and its usage adds up to `count_tokens`),
replies equal a server's without the session cache and chat completions' for the same conversation, the SDK's
stream helpers, a tool round trip, every bad input an SDK exception of the right class with nothing kept,
`cache_control` keeping a policy resident through an eviction flood, and `cache_salt` isolation across two workers
on Redis."""

from __future__ import annotations

import contextlib
import json

import anthropic
import httpx
import jsonschema
import openai
import pytest

from chatd.api.server import ChatServer
from chatd.config import Settings
from tests.support import kv_budget_mb, openai_client

MODEL = "smollm2-135m"
SYSTEM = "You are the support assistant of Northwind Telecom. Answer in one short sentence."
QUESTIONS = ["My internet is down since this morning.", "I already restarted the router.",
             "The light on it is blinking red."]
LOOKUP = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^NW-[0-9]{4}$"}},
          "required": ["order_id"], "additionalProperties": False}
TOOLS = [{"name": "lookup_order", "description": "Find an order by its id.", "input_schema": LOOKUP}]
GREEDY = {"temperature": 0}  # (the SDK no longer types temperature, top_p, top_k: they travel in the body)


def anthropic_client(server: ChatServer, api_key: str = "unused") -> anthropic.AsyncAnthropic:
    """An `anthropic` client of `server`, which fails at once rather than retrying."""
    return anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=api_key, max_retries=0)


@contextlib.asynccontextmanager
async def served(smollm2, **settings):
    async with ChatServer(Settings(port=0, **settings), load=lambda: smollm2) as server:
        await server.wait_ready()
        yield server


@pytest.fixture
async def anthropic_pair(smollm2):
    """SmolLM2 served with and without the session cache: (server, client, uncached client)."""
    async with served(smollm2) as server, served(smollm2, session_cache=False) as uncached:
        async with anthropic_client(server) as client, anthropic_client(uncached) as reference:
            yield server, client, reference


async def _streamed(client: anthropic.AsyncAnthropic, **request):
    async with client.messages.stream(**request) as stream:
        return await stream.get_final_message()


def text_of(message) -> str:
    return "".join(block.text for block in message.content if block.type == "text")


async def test_a_conversation_resent_whole_reads_its_history_from_the_cache(anthropic_pair):
    _, client, uncached = anthropic_pair
    messages, previous = [], None
    for turn, question in enumerate(QUESTIONS):
        messages.append({"role": "user", "content": question})
        reply = await client.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=messages,
                                             extra_body=GREEDY)
        expected = await uncached.messages.create(model=MODEL, max_tokens=12, system=SYSTEM, messages=messages,
                                                  extra_body=GREEDY)
        assert text_of(reply) == text_of(expected), f"turn {turn}"
        assert reply.id.startswith("msg_") and reply.stop_reason in ("end_turn", "max_tokens")
        counted = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
        usage = reply.usage
        assert usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens == \
            counted.input_tokens
        assert usage.cache_creation_input_tokens == 0, "no breakpoint: nothing counts as written"
        if previous is not None:  # the history up to the last reply comes from the cache
            assert usage.cache_read_input_tokens >= previous.input_tokens + previous.cache_read_input_tokens + \
                previous.output_tokens - 1, (turn, usage, previous)
        assert expected.usage.cache_read_input_tokens == 0
        previous = usage
        messages.append({"role": "assistant", "content": reply.content[0].text})


async def test_chat_completions_continue_the_same_conversation_on_the_same_cache(anthropic_pair):
    server, client, uncached = anthropic_pair
    first = await client.messages.create(model=MODEL, max_tokens=10, system=SYSTEM, extra_body=GREEDY,
                                         messages=[{"role": "user", "content": QUESTIONS[0]}])
    history = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": text_of(first)},
               {"role": "user", "content": QUESTIONS[1]}]
    expected = await uncached.messages.create(model=MODEL, max_tokens=10, system=SYSTEM, extra_body=GREEDY,
                                              messages=history)
    async with openai_client(server) as openai:
        completion = await openai.chat.completions.create(
            model=MODEL, max_tokens=10, temperature=0, messages=[{"role": "system", "content": SYSTEM}, *history])
    assert completion.choices[0].message.content == text_of(expected)
    assert completion.usage.prompt_tokens == expected.usage.input_tokens, "the same prompt through either API"
    cached = completion.usage.prompt_tokens_details.cached_tokens
    assert cached >= first.usage.input_tokens + first.usage.output_tokens - 1, "the Messages turn's cache, reused"


async def test_the_sdk_stream_helpers_assemble_the_message(anthropic_pair):
    _, client, uncached = anthropic_pair
    messages = [{"role": "user", "content": QUESTIONS[2]}]
    kinds = []
    async with client.messages.stream(model=MODEL, max_tokens=16, system=SYSTEM, messages=messages,
                                      extra_body=GREEDY, stop_sequences=["router"]) as stream:
        pieces = [text async for text in stream.text_stream]
        final = await stream.get_final_message()
    async with client.messages.stream(model=MODEL, max_tokens=16, system=SYSTEM, messages=messages,
                                      extra_body=GREEDY) as events:
        streamed = [event async for event in events]
    kinds = [event.type for event in streamed]
    # The prompt's usage is known before the first token: clients that read it from message_start record it.
    started = streamed[0].message.usage
    counted = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert started.input_tokens + started.cache_read_input_tokens + started.cache_creation_input_tokens == \
        counted.input_tokens > 0
    expected = await uncached.messages.create(model=MODEL, max_tokens=16, system=SYSTEM, messages=messages,
                                              extra_body=GREEDY, stop_sequences=["router"])
    assert "".join(pieces) == text_of(final) == text_of(expected)
    assert (final.stop_reason, final.stop_sequence) == (expected.stop_reason, expected.stop_sequence)
    assert final.usage.output_tokens == expected.usage.output_tokens > 0
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "message_delta" in kinds
    assert kinds.index("content_block_start") < kinds.index("content_block_stop") < kinds.index("message_delta")


async def test_a_tool_round_trip_with_tool_choice_any(anthropic_pair):
    _, client, uncached = anthropic_pair
    messages = [{"role": "user", "content": "Where is my order NW-2231? It never arrived."}]
    call = await client.messages.create(model=MODEL, max_tokens=48, system=SYSTEM, messages=messages, tools=TOOLS,
                                        tool_choice={"type": "any"}, extra_body=GREEDY)
    expected = await uncached.messages.create(model=MODEL, max_tokens=48, system=SYSTEM, messages=messages,
                                              tools=TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY)
    uses = [block for block in call.content if block.type == "tool_use"]
    assert call.stop_reason == "tool_use" and uses and uses[0].id.startswith("toolu_")
    assert [(u.name, u.input) for u in uses] == [(b.name, b.input) for b in expected.content if b.type == "tool_use"]
    for use in uses:
        assert use.name == "lookup_order"
        jsonschema.validate(use.input, LOOKUP)
    async with client.messages.stream(model=MODEL, max_tokens=48, system=SYSTEM, messages=messages, tools=TOOLS,
                                      tool_choice={"type": "any"}, extra_body=GREEDY) as stream:
        streamed = await stream.get_final_message()
    assert [b.input for b in streamed.content if b.type == "tool_use"] == [u.input for u in uses], \
        "input_json_delta assembled by the SDK"
    # A reply of calls alone has no (empty) text block, streamed or not.
    assert [block.type for block in streamed.content] == [block.type for block in call.content] == \
        ["tool_use"] * len(uses), (streamed.content, call.content)
    # Cut by max_tokens while the call is being written: max_tokens, and never the call's raw text.
    for cut in (await client.messages.create(model=MODEL, max_tokens=6, system=SYSTEM, messages=messages,
                                             tools=TOOLS, tool_choice={"type": "any"}, extra_body=GREEDY),
                await _streamed(client, model=MODEL, max_tokens=6, system=SYSTEM, messages=messages, tools=TOOLS,
                                tool_choice={"type": "any"}, extra_body=GREEDY)):
        assert cut.stop_reason == "max_tokens" and not any(block.type == "tool_use" for block in cut.content)
        assert "lookup_order" not in text_of(cut) and "{" not in text_of(cut), cut.content
    messages += [{"role": "assistant", "content": [block.model_dump() for block in call.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                               "content": json.dumps({"status": "lost in transit"})}
                                              for use in uses]}]
    answer = await client.messages.create(model=MODEL, max_tokens=24, system=SYSTEM, messages=messages,
                                          tools=TOOLS, extra_body=GREEDY)
    assert answer.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # Only the tool result and the template's tokens around it are prefilled: the rest is read from the cache.
    assert answer.usage.cache_read_input_tokens >= call.usage.input_tokens + call.usage.cache_read_input_tokens + \
        call.usage.output_tokens - 1, (answer.usage, call.usage)


async def test_the_automatic_breakpoint_counts_the_whole_prompt_as_written_then_read(anthropic_pair):
    """The current SDK's automatic form (a top-level `cache_control`: the last block) writes the whole prompt on the
    first turn; the next turn reads it back and writes only what it added."""
    _, client, _ = anthropic_pair
    messages = [{"role": "user", "content": QUESTIONS[0]}]
    first = await client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=messages,
                                         cache_control={"type": "ephemeral"}, extra_body=GREEDY)
    counted = await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)
    assert (first.usage.input_tokens, first.usage.cache_creation_input_tokens) == (0, counted.input_tokens)
    messages += [{"role": "assistant", "content": text_of(first)}, {"role": "user", "content": QUESTIONS[1]}]
    second = await client.messages.create(model=MODEL, max_tokens=4, system=SYSTEM, messages=messages,
                                          cache_control={"type": "ephemeral"}, extra_body=GREEDY)
    usage = second.usage
    assert usage.input_tokens == 0 and usage.cache_read_input_tokens >= counted.input_tokens
    assert usage.cache_read_input_tokens + usage.cache_creation_input_tokens == \
        (await client.messages.count_tokens(model=MODEL, system=SYSTEM, messages=messages)).input_tokens


async def test_output_config_format_holds_the_reply_to_its_schema(anthropic_pair):
    _, client, uncached = anthropic_pair
    ticket = {"type": "object", "properties": {
        "category": {"type": "string", "enum": ["billing", "outage", "hardware", "other"]},
        "priority": {"type": "integer", "minimum": 1, "maximum": 4}},
        "required": ["category", "priority"], "additionalProperties": False}
    arguments = dict(model=MODEL, max_tokens=64, system="File the customer's problem as a ticket, in JSON.",
                     messages=[{"role": "user", "content": "My router blinks red and nothing loads."}],
                     output_config={"format": {"type": "json_schema", "schema": ticket}}, extra_body=GREEDY)
    reply, expected = await client.messages.create(**arguments), await uncached.messages.create(**arguments)
    assert reply.stop_reason == "end_turn" and text_of(reply) == text_of(expected)
    jsonschema.validate(json.loads(text_of(reply)), ticket)


async def test_bad_input_is_an_sdk_exception_of_its_class_and_nothing_is_kept(smollm2):
    user = [{"role": "user", "content": "Hi"}]
    marked = {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}
    cases = [
        (anthropic.NotFoundError, dict(model="claude-sonnet-4-5", messages=user), "not_found_error"),
        (anthropic.BadRequestError, dict(messages=user, tools=TOOLS, tool_choice={"type": "tool", "name": "refund"}),
         "invalid_request_error"),
        (anthropic.BadRequestError, dict(messages=[*user, {"role": "assistant", "content": "Sure,"}]),
         "invalid_request_error"),
        (anthropic.BadRequestError, dict(messages=[{"role": "user", "content": [
            {"type": "image", "source": {"type": "url", "url": "http://example.invalid/a.png"}}]}]),
         "invalid_request_error"),
        (anthropic.BadRequestError, dict(messages=user, extra_body={"temperature": 1.5}), "invalid_request_error"),
        (anthropic.BadRequestError, dict(messages=[{"role": "user", "content": [marked] * 5}]),
         "invalid_request_error"),
        (anthropic.BadRequestError, dict(messages=[*user, {"role": "assistant", "content": "Hello"},
                                                   {"role": "user", "content": [{"type": "tool_result",
                                                                                 "tool_use_id": "toolu_nobody"}]}]),
         "invalid_request_error"),
        (anthropic.BadRequestError, dict(messages=user, output_config={"format": {"type": "json_schema", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}), "invalid_request_error"),
    ]
    async with served(smollm2, api_key=["sk-right"]) as server:
        async with anthropic_client(server, "sk-right") as client, anthropic_client(server, "sk-wrong") as stranger:
            for error, arguments, kind in cases:
                with pytest.raises(error) as refused:
                    await client.messages.create(**{"model": MODEL, "max_tokens": 8, **arguments})
                assert refused.value.body["type"] == "error" and refused.value.body["error"]["type"] == kind, \
                    (arguments, refused.value.body)
            with pytest.raises(anthropic.AuthenticationError):
                await stranger.messages.create(model=MODEL, max_tokens=8, messages=user)
            with pytest.raises(anthropic.NotFoundError):
                await client.messages.count_tokens(model="claude-sonnet-4-5", messages=user)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
                missing = await http.post("/v1/messages?beta=true", json={"model": MODEL, "messages": user},
                                          headers={"x-api-key": "sk-right", "anthropic-version": "2023-06-01",
                                                   "anthropic-beta": "some-future-feature-2030-01-01"})
            assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
            assert "max_tokens" in missing.json()["error"]["message"]
            assert not server.sessions._sessions, "nothing is kept of a refused request"
            server.turns.draining = True
            with pytest.raises(anthropic.OverloadedError):
                await client.messages.create(model=MODEL, max_tokens=8, messages=user)
            server.turns.draining = False
            reply = await client.messages.create(model=MODEL, max_tokens=4, messages=user)
            assert reply.content, "the server goes on serving"


async def test_cache_control_keeps_a_policy_resident_through_an_eviction_flood(smollm2):
    """A session whose policy is marked `cache_control` (1h), OpenAI's `prompt_cache_options.ttl` and an explicit
    `prompt_cache_breakpoint` (30m), and one that is not: after other customers fill the device many times over (and
    the host tier holds nothing), the marked ones read their whole history from the cache, the other recomputes."""
    policy = "You are the billing desk of Northwind Telecom. " + "Refunds take five working days. " * 20
    async with served(smollm2, device_cache_mb=kv_budget_mb(smollm2, 900), host_cache_mb=0) as server:
        async with anthropic_client(server) as client:
            async def turn(system, question, history=()):
                return await client.messages.create(model=MODEL, max_tokens=6, extra_body=GREEDY, system=system,
                                                    messages=[*history, {"role": "user", "content": question}])

            marked_system = [{"type": "text", "text": policy, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
            marked = await turn(marked_system, QUESTIONS[0])
            plain = await turn(policy.replace("billing", "sales"), QUESTIONS[0])
            async with openai_client(server) as responses:  # OpenAI's own control: `prompt_cache_options.ttl`
                kept = await responses.responses.create(
                    model=MODEL, instructions=policy.replace("billing", "repairs"), input=QUESTIONS[0],
                    max_output_tokens=6, temperature=0, extra_body={"prompt_cache_options": {"ttl": "12h"}})
                breakpoint_text = [{"type": "input_text", "text": policy.replace("billing", "moves"),  # a breakpoint
                                    "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "30m"}}]
                broken = await responses.responses.create(
                    model=MODEL, input=[{"role": "developer", "content": breakpoint_text},
                                        {"role": "user", "content": QUESTIONS[0]}],
                    max_output_tokens=6, temperature=0, extra_body={"prompt_cache_options": {"mode": "explicit"}})
                for index in range(6):  # other customers, each with a policy of its own: the device fills again
                    await turn(policy.replace("billing", f"desk {index}"), QUESTIONS[1])
                stats = server.engine.call(lambda store: store.stats()).result()
                assert stats["kept_sessions"] == 3 and stats.get("device_evictions", 0) >= 4, stats
                still, after_break = [await responses.responses.create(
                    model=MODEL, previous_response_id=previous.id, input=QUESTIONS[1], max_output_tokens=6,
                    temperature=0) for previous in (kept, broken)]
            assert still.usage.input_tokens_details.cached_tokens >= kept.usage.total_tokens - 1, still.usage
            assert after_break.usage.input_tokens_details.cached_tokens >= broken.usage.total_tokens - 1
            assert kept.usage.input_tokens_details.cache_write_tokens == kept.usage.input_tokens
            history = [{"role": "user", "content": QUESTIONS[0]}]
            again = await turn(marked_system, QUESTIONS[1], [*history, {"role": "assistant",
                                                                         "content": text_of(marked)}])
            lost = await turn(policy.replace("billing", "sales"), QUESTIONS[1],
                              [*history, {"role": "assistant", "content": text_of(plain)}])
    assert again.usage.cache_read_input_tokens >= marked.usage.input_tokens + marked.usage.cache_creation_input_tokens \
        + marked.usage.output_tokens - 1, again.usage
    assert marked.usage.cache_creation_input_tokens > 100, "the policy counts as written at its breakpoint"
    assert marked.usage.cache_creation.ephemeral_1h_input_tokens == marked.usage.cache_creation_input_tokens
    assert lost.usage.cache_read_input_tokens < 16, lost.usage


async def test_cache_salt_isolates_caches_across_two_workers_on_redis(tiny, redis_db):
    settings = dict(port=0, redis_url=redis_db.url, remote_kv=True, remote_kv_fetch="always")
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTIONS[0]}]
    async with ChatServer(Settings(**settings), load=lambda: tiny) as first, \
            ChatServer(Settings(**settings), load=lambda: tiny) as second:
        await first.wait_ready()
        await second.wait_ready()
        async with openai_client(first) as on_first, openai_client(second) as on_second:
            reply = await on_first.chat.completions.create(model=MODEL, messages=messages, max_tokens=6,
                                                           temperature=0, extra_body={"cache_salt": "tenant-a"})
            history = [*messages, {"role": "assistant", "content": reply.choices[0].message.content},
                       {"role": "user", "content": QUESTIONS[1]}]
            other = await on_second.chat.completions.create(model=MODEL, messages=history, max_tokens=6,
                                                            temperature=0, extra_body={"cache_salt": "tenant-b"})
            unsalted = await on_second.chat.completions.create(model=MODEL, messages=history, max_tokens=6,
                                                               temperature=0)
            same = await on_second.chat.completions.create(model=MODEL, messages=history, max_tokens=6,
                                                           temperature=0, extra_body={"cache_salt": "tenant-a"})
            responses = {salt: await on_second.responses.create(model=MODEL, input=history, max_output_tokens=6,
                                                                temperature=0, extra_body={"cache_salt": salt})
                         for salt in ("tenant-c", "tenant-a")}
            salted = responses["tenant-a"]
            assert (await on_first.responses.retrieve(salted.id)).id == salted.id, "a salted response is the key's"
            follow = await on_first.responses.create(model=MODEL, previous_response_id=salted.id, input="Thanks.",
                                                     max_output_tokens=4, extra_body={"cache_salt": "tenant-a"})
            with pytest.raises(openai.NotFoundError):
                await on_first.responses.create(model=MODEL, previous_response_id=salted.id, input="Thanks.",
                                                max_output_tokens=4, extra_body={"cache_salt": "tenant-b"})
            conversation = await on_first.conversations.create()
            with pytest.raises(openai.BadRequestError) as refused:
                await on_first.responses.create(model=MODEL, conversation=conversation.id, input="Hi",
                                                max_output_tokens=4, extra_body={"cache_salt": "tenant-a"})
            assert refused.value.body["param"] == "cache_salt"
    assert other.usage.prompt_tokens_details.cached_tokens == 0, "another salt never shares a cache"
    assert unsalted.usage.prompt_tokens_details.cached_tokens == 0, "nor does no salt"
    assert same.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens, \
        "the same salt continues on the other worker from Redis"
    assert other.choices[0].message.content == same.choices[0].message.content
    assert responses["tenant-c"].usage.input_tokens_details.cached_tokens == 0, "the Responses API too"
    assert responses["tenant-a"].usage.input_tokens_details.cached_tokens >= reply.usage.prompt_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= salted.usage.input_tokens, "continued from its cache"


async def test_cache_creation_is_split_by_ttl_and_a_1h_breakpoint_after_a_5m_one_is_refused(tiny):
    """Anthropic's usage splits what a turn wrote by the ttl of the breakpoint that covers it; as Anthropic's API, a
    1h breakpoint may not follow a 5m one."""
    async with ChatServer(Settings(port=0, model=MODEL), load=lambda: tiny) as server:
        await server.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            def body(system_ttl: str, message_ttl: str) -> dict:
                return {"model": MODEL, "max_tokens": 4, "temperature": 0, "system": [
                    {"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": system_ttl}}],
                    "messages": [{"role": "user", "content": [{"type": "text", "text": QUESTIONS[0],
                                                               "cache_control": {"type": "ephemeral",
                                                                                 "ttl": message_ttl}}]}]}

            response = await http.post("/v1/messages", json=body("1h", "5m"))
            assert response.status_code == 200, response.text
            usage = response.json()["usage"]
            split = usage["cache_creation"]
            assert split["ephemeral_1h_input_tokens"] > 0 and split["ephemeral_5m_input_tokens"] > 0, usage
            assert split["ephemeral_1h_input_tokens"] + split["ephemeral_5m_input_tokens"] == \
                usage["cache_creation_input_tokens"]
            refused = await http.post("/v1/messages", json=body("5m", "1h"))
            assert refused.status_code == 400 and "1h" in refused.json()["error"]["message"], refused.text
