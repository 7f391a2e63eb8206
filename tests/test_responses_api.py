"""The Responses and Conversations APIs with the tiny model and the official `openai` client: a conversation
continued by `previous_response_id` resumes its session's cache and answers like the websocket path,
branches, conversations, storage in Redis across a restart, isolation between keys, and errors."""

from __future__ import annotations

import asyncio
import importlib.util

import httpx
import openai
import pytest
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.model.prompt import PromptRenderer
from sessions import Message

MODEL = "tiny-test"
SYSTEM = "You are the support desk of a small internet provider. Answer briefly and politely."
QUESTIONS = ["My internet is down.", "The router light is red.", "I restarted it already.", "Still nothing.",
             "Can a technician come?", "Tomorrow morning works.", "What will it cost?", "Thanks, goodbye."]


def client_for(server: ChatServer, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)


async def respond(client: openai.AsyncOpenAI, text: str, previous: str | None = None, stream: bool = False,
                  **extra):
    """One response (streamed or not), as the SDK returns it; a stream is read to its final response."""
    arguments = {"model": MODEL, "input": text, "max_output_tokens": 8, "temperature": 0, **extra}
    if previous is not None:
        arguments["previous_response_id"] = previous
    if not stream:
        return await client.responses.create(**arguments)
    kinds, deltas, final = [], [], None
    async for event in await client.responses.create(stream=True, **arguments):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        if event.type in ("response.completed", "response.incomplete"):
            final = event.response
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:-1] == ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert kinds[-1] == ("response.completed" if final.status == "completed" else "response.incomplete")
    assert "".join(deltas) == final.output_text
    return final


@pytest.fixture
async def servers(tiny):
    async with ChatServer(Settings(port=0, model=MODEL, verify_sample_rate=0.0), load=lambda: tiny) as server, \
            ChatServer(Settings(port=0, model=MODEL, session_cache=False), load=lambda: tiny) as reference:
        await server.wait_ready()
        await reference.wait_ready()
        yield server, reference


async def test_previous_response_id_resumes_the_session_and_answers_like_the_websocket_path(servers):
    server, reference = servers
    client = client_for(server)
    async with ChatClient(await connect(reference.url)) as websocket:
        session_id = (await websocket.open_session(system=SYSTEM)).session_id
        previous, last = None, None
        for turn, question in enumerate(QUESTIONS, start=1):
            response = await respond(client, question, previous, stream=turn % 2 == 0,
                                     instructions=SYSTEM if previous is None else None)
            expected = await (await websocket.chat(session_id, question, max_new_tokens=8)).result()
            assert response.output_text == expected.content, f"turn {turn}"
            assert response.status in ("completed", "incomplete") and response.usage.output_tokens > 0
            usage = response.usage
            if previous is not None:
                # Everything but the new input came from the session's cache (a reply cut at max_output_tokens
                # ends with a token that was sampled, never fed: it is the first one the next turn feeds).
                assert usage.input_tokens_details.cached_tokens >= last.input_tokens + last.output_tokens - 1
                assert usage.input_tokens_details.cached_tokens < usage.input_tokens
            assert response.previous_response_id == previous
            previous, last = response.id, usage
    metrics = (await httpx.AsyncClient().get(f"http://127.0.0.1:{server.port}/metrics")).text
    assert f'chatd:api_requests_total{{api="responses",model_name="{MODEL}"}} {len(QUESTIONS)}.0' in metrics
    stored = await client.responses.retrieve(previous)
    assert stored.output_text == response.output_text and stored.usage.input_tokens == last.input_tokens
    items = await client.responses.input_items.list(previous)
    assert [item.content[0].text for item in items.data] == [QUESTIONS[-1]]


async def test_continuing_the_latest_response_resumes_its_session_and_an_earlier_one_branches(servers):
    """A response records its session's point after its turn: continuing the latest one resumes that session (a
    point counted one turn ahead once made every continuation a branch, which only a cache on the same worker hid)."""
    server, _ = servers
    raw = client_for(server).responses.with_raw_response
    first = await raw.create(model=MODEL, input=QUESTIONS[0], max_output_tokens=4, temperature=0)
    second = await raw.create(model=MODEL, input=QUESTIONS[1], max_output_tokens=4, temperature=0,
                              previous_response_id=first.parse().id)
    assert second.headers["x-chatd-session-id"] == first.headers["x-chatd-session-id"]
    again = await raw.create(model=MODEL, input=QUESTIONS[1], max_output_tokens=4, temperature=0,
                             previous_response_id=first.parse().id)
    assert again.headers["x-chatd-session-id"] != first.headers["x-chatd-session-id"], "an earlier point: a branch"
    assert again.parse().output_text == second.parse().output_text


async def test_two_requests_from_one_response_at_once_branch_and_neither_changes_the_other(servers):
    server, reference = servers
    client, solo = client_for(server), client_for(reference)
    chain, solo_chain = [], []
    for question in QUESTIONS[:3]:
        chain.append(await respond(client, question, chain[-1].id if chain else None,
                                    instructions=None if chain else SYSTEM))
        solo_chain.append(await respond(solo, question, solo_chain[-1].id if solo_chain else None,
                                         instructions=None if solo_chain else SYSTEM))
    edits = ["Actually, the light is green.", "Never mind, it works now."]
    # Both continue the latest response at once: one resumes the session, the other branches from it.
    branched = await asyncio.gather(*(respond(client, edit, chain[-1].id) for edit in edits))
    for edit, response in zip(edits, branched, strict=True):
        assert response.output_text == (await respond(solo, edit, solo_chain[-1].id)).output_text
    # Regenerate from the first response (an earlier point): a branch that sees only turn 1.
    regenerated = await respond(client, QUESTIONS[1], chain[0].id)
    assert regenerated.output_text == chain[1].output_text
    assert regenerated.usage.input_tokens == chain[1].usage.input_tokens
    # Each branch goes on with its own history only.
    for edit, response in zip(edits, branched, strict=True):
        after = await respond(client, "What next?", response.id)
        solo_branch = await respond(solo, edit, solo_chain[-1].id)
        assert after.output_text == (await respond(solo, "What next?", solo_branch.id)).output_text


async def test_conversations_hold_the_turns_of_responses_and_of_the_websocket(servers):
    server, _ = servers
    client = client_for(server)
    conversation = await client.conversations.create(
        items=[{"type": "message", "role": "system", "content": SYSTEM},
               {"type": "message", "role": "user", "content": "Hello."},
               {"type": "message", "role": "assistant", "content": "Hello! How can I help?"}],
        metadata={"ticket": "42"})
    assert (await client.conversations.retrieve(conversation.id)).metadata == {"ticket": "42"}
    first = await respond(client, QUESTIONS[0], conversation=conversation.id)
    assert first.conversation.id == conversation.id and first.usage.input_tokens_details.cached_tokens == 0
    second = await respond(client, QUESTIONS[1], conversation=conversation.id)
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens + first.usage.output_tokens - 1
    async with ChatClient(await connect(server.url)) as websocket:  # a conversation is a session
        ready = await websocket.open_session(session_id=conversation.id)
        assert ready.turns == 3
        await (await websocket.chat(conversation.id, "And by websocket?", max_new_tokens=4)).result()
    items = await client.conversations.items.list(conversation.id, order="asc")
    texts = [item.content[0].text for item in items.data]
    assert texts[:4] == [SYSTEM, "Hello.", "Hello! How can I help?", QUESTIONS[0]]
    assert texts[-2] == "And by websocket?" and len(texts) == 1 + 2 * 4
    deleted = await client.conversations.delete(conversation.id)
    assert deleted.deleted
    with pytest.raises(openai.NotFoundError):
        await client.conversations.retrieve(conversation.id)


async def test_responses_and_conversations_survive_a_restart_with_redis(tiny, redis_db):
    settings = Settings(port=0, model=MODEL, redis_url=redis_db.url)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        client = client_for(server)
        first = await respond(client, QUESTIONS[0], instructions=SYSTEM)
        second = await respond(client, QUESTIONS[1], first.id)
    async with ChatServer(settings, load=lambda: tiny) as restarted, \
            ChatServer(Settings(port=0, model=MODEL, session_cache=False), load=lambda: tiny) as reference:
        for started in (restarted, reference):  # (a request before the model is loaded is answered 503)
            await started.wait_ready()
        client, solo = client_for(restarted), client_for(reference)
        third = await respond(client, QUESTIONS[2], second.id)
        solo_chain = [await respond(solo, QUESTIONS[0], instructions=SYSTEM)]
        for question in QUESTIONS[1:3]:
            solo_chain.append(await respond(solo, question, solo_chain[-1].id))
        assert third.output_text == solo_chain[-1].output_text
        assert third.usage.input_tokens == solo_chain[-1].usage.input_tokens
        assert (await client.responses.retrieve(first.id)).output_text == first.output_text


async def test_keys_store_false_and_bad_input_get_openai_errors(tiny):
    settings = Settings(port=0, model=MODEL, api_key=["key-a", "key-b"])
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        mine, theirs = client_for(server, "key-a"), client_for(server, "key-b")
        response = await respond(mine, QUESTIONS[0], instructions=SYSTEM)
        for call in (theirs.responses.retrieve(response.id), theirs.responses.input_items.list(response.id),
                     theirs.responses.delete(response.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        with pytest.raises(openai.NotFoundError) as other_key:
            await respond(theirs, "hi", response.id)
        assert other_key.value.body["code"] == "previous_response_not_found"
        sessions_before = len(server.sessions)
        unstored = await respond(mine, "Do not keep this.", response.id, store=False)
        assert unstored.output_text and len(server.sessions) == sessions_before, "its session is gone"
        with pytest.raises(openai.NotFoundError):
            await mine.responses.retrieve(unstored.id)
        with pytest.raises(openai.NotFoundError) as unknown:
            await respond(mine, "hi", "resp_unknown")
        assert unknown.value.body["param"] == "previous_response_id"
        for bad, param in [({"tools": [{"type": "web_search"}]}, "tools[0].type"), ({"reasoning": {"effort": "low"}},
                                                                            "reasoning"),
                           ({"background": True}, "background"), ({"include": ["file_search_call.results"]},
                                                                  "include")]:
            with pytest.raises(openai.BadRequestError) as refused:
                await mine.responses.create(model=MODEL, input="hi", **bad)
            assert refused.value.body["param"] == param
        with pytest.raises(openai.BadRequestError):
            await mine.responses.create(model=MODEL, input=123)
        with pytest.raises(openai.NotFoundError):
            await mine.responses.create(model="another-model", input="hi")
        await mine.responses.delete(response.id)
        with pytest.raises(openai.NotFoundError):
            await mine.responses.retrieve(response.id)
        assert (await respond(mine, QUESTIONS[1], instructions=SYSTEM)).output_text  # still serving


@pytest.mark.skipif(importlib.util.find_spec("agents") is None, reason="openai-agents is not installed")
async def test_the_openai_agents_sdk_runs_a_two_turn_agent(smollm2):
    """The Agents SDK with the real model (a random one never ends its reply, and the SDK refuses an
    incomplete response)."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    async with ChatServer(Settings(port=0), load=lambda: smollm2) as server:
        await server.wait_ready()
        client = client_for(server)
        model = (await client.models.list()).data[0].id
        agent = Agent(name="support", instructions=SYSTEM, model=OpenAIResponsesModel(model, client),
                      model_settings=ModelSettings(temperature=0))  # greedy: a short reply, never cut off
        first = await Runner.run(agent, "Hi, my internet is down. Say only: we will help.")
        second = await Runner.run(agent, "Thank you. Say only: goodbye.", previous_response_id=first.last_response_id)
        assert first.final_output and second.final_output
        stored = await client.responses.retrieve(second.last_response_id)
        assert stored.previous_response_id == first.last_response_id
        assert stored.output_text == second.final_output and stored.usage.input_tokens_details.cached_tokens > 0


async def test_item_references_resolve_to_stored_items_on_any_worker(tiny, redis_db):
    """The AI SDK's history with `store` on: earlier replies sent as `item_reference` by their ids. Each resolves to
    the stored item (on another worker through Redis), the conversation continues its session from the cache and
    answers as the whole conversation sent as text does; reasoning items are passed over; another key's item, an
    unknown id and an image part are refused naming the item."""
    settings = Settings(port=0, model=MODEL, redis_url=redis_db.url, api_key=["key-a", "key-b"])
    async with ChatServer(settings, load=lambda: tiny) as one, ChatServer(settings, load=lambda: tiny) as two, \
            ChatServer(Settings(port=0, model=MODEL, session_cache=False), load=lambda: tiny) as reference:
        for started in (one, two, reference):
            await started.wait_ready()
        first = await respond(client_for(one, "key-a"), QUESTIONS[0], instructions=SYSTEM)
        history = [{"role": "user", "content": QUESTIONS[0]}, {"type": "reasoning", "id": "rs_1", "summary": []},
                   {"type": "item_reference", "id": first.output[0].id},
                   {"role": "user", "content": QUESTIONS[1]}]
        second = await client_for(one, "key-a").responses.create(model=MODEL, input=history, instructions=SYSTEM,
                                                                  max_output_tokens=8, temperature=0)
        texts = [{"role": "user", "content": QUESTIONS[0]}, {"role": "assistant", "content": first.output_text},
                 {"role": "user", "content": QUESTIONS[1]}]
        solo = await client_for(reference).responses.create(model=MODEL, instructions=SYSTEM, input=texts,
                                                             max_output_tokens=8, temperature=0)
        assert second.output_text == solo.output_text
        assert second.usage.input_tokens == solo.usage.input_tokens
        assert second.usage.input_tokens_details.cached_tokens >= 0.6 * second.usage.input_tokens
        # On the other worker (the items through Redis; the cache is the first worker's, so it recomputes).
        third = await client_for(two, "key-a").responses.create(
            model=MODEL, instructions=SYSTEM, max_output_tokens=8, temperature=0, input=history + [
                {"type": "item_reference", "id": second.output[0].id}, {"role": "user", "content": QUESTIONS[2]}])
        solo = await client_for(reference).responses.create(model=MODEL, instructions=SYSTEM, input=texts + [
            {"role": "assistant", "content": second.output_text}, {"role": "user", "content": QUESTIONS[2]}],
            max_output_tokens=8, temperature=0)
        assert third.output_text == solo.output_text and third.usage.input_tokens == solo.usage.input_tokens
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{one.port}") as http:
            refusals = [
                ("key-b", [{"role": "user", "content": "hi"}, {"type": "item_reference", "id": first.output[0].id},
                           {"role": "user", "content": "and?"}], "input[1].id"),
                ("key-a", [{"type": "item_reference", "id": "msg_unknown"}, {"role": "user", "content": "x"}],
                 "input[0].id"),
                ("key-a", [{"role": "user", "content": [{"type": "input_text", "text": "What is this?"},
                                                        {"type": "input_image", "image_url": "data:,"}]}],
                 "input[0].content[1]"),
                ("key-a", [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"},
                           {"role": "user", "content": 5}], "input[2].content"),
            ]
            for key, items, param in refusals:
                response = await http.post("/v1/responses", json={"model": MODEL, "input": items},
                                           headers={"Authorization": f"Bearer {key}"})
                assert response.status_code == 400, response.text
                assert response.json()["error"]["param"] == param, response.json()
            response = await http.post("/v1/chat/completions", headers={"Authorization": "Bearer key-a"}, json={
                "model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                "tool_choice": {"type": "function"}})
            assert response.status_code == 400 and response.json()["error"]["param"].startswith("tool_choice"), \
                response.text


async def test_store_false_resending_the_whole_history_reads_it_from_the_cache(servers):
    """OpenAI's prompt cache does not depend on `store`: a client that keeps its own history and sends it whole with
    `store: false` reads it from the cache on every later turn (matched like a chat completion), answers as a cacheless
    server, and none of its responses is stored."""
    server, reference = servers
    client, solo = client_for(server), client_for(reference)
    history: list[dict] = []
    for turn, question in enumerate(QUESTIONS[:4]):
        history.append({"role": "user", "content": question})
        got, expected = [await each.responses.create(model=MODEL, instructions=SYSTEM, input=history, store=False,
                                                     max_output_tokens=8, temperature=0) for each in (client, solo)]
        assert got.output_text == expected.output_text
        if turn:
            assert got.usage.input_tokens_details.cached_tokens >= 0.7 * got.usage.input_tokens, got.usage
        with pytest.raises(openai.NotFoundError):
            await client.responses.retrieve(got.id)
        history.append({"role": "assistant", "content": got.output_text})


async def test_conversation_items_are_added_listed_in_either_order_and_read_from_the_cache(servers):
    """openai-agents' `OpenAIConversationsSession` keeps a run's history with `conversations.items.create` and reads
    it newest first: items added are recorded and prefilled into the conversation's cache (its next response reads
    them from it), listed in either order with a cursor, and retrieved by id; a tool output that answers no call is
    refused naming it."""
    server, _ = servers
    client = client_for(server)
    conversation = await client.conversations.create(items=[{"role": "system", "content": SYSTEM}])
    added = await client.conversations.items.create(conversation.id, items=[
        {"role": "user", "content": QUESTIONS[0]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me check."}]},
        {"type": "function_call", "call_id": "call_1", "name": "lookup_line", "arguments": "{\"line\": \"7\"}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "{\"status\": \"down\"}"}])
    assert [item.type for item in added.data] == ["message", "message", "function_call", "function_call_output"]
    oldest = [item.id async for item in client.conversations.items.list(conversation.id, order="asc")]
    newest = [item.id async for item in client.conversations.items.list(conversation.id, order="desc", limit=2)]
    assert len(oldest) == 5 and newest == oldest[::-1], (oldest, newest)  # (pages of 2, followed by the cursor)
    assert (await client.conversations.items.retrieve(added.data[0].id, conversation_id=conversation.id)).id == \
        added.data[0].id
    answer = await respond(client, QUESTIONS[1], conversation=conversation.id)
    assert answer.usage.input_tokens_details.cached_tokens >= 0.8 * answer.usage.input_tokens, answer.usage
    with pytest.raises(openai.BadRequestError) as refused:
        await client.conversations.items.create(conversation.id, items=[
            {"type": "function_call_output", "call_id": "call_9", "output": "x"}])
    assert refused.value.body["param"] == "items[0].call_id"


async def test_truncation_disabled_refuses_a_conversation_over_the_context_and_auto_drops_turns(servers):
    """OpenAI's default `truncation: disabled`: a chain that outgrows the model's context (512 tokens here) is
    refused with `context_length_exceeded` (and nothing is recorded); `auto` drops its oldest turns and answers."""
    server, _ = servers
    client = client_for(server)
    long_question = "Please read my whole account history again: " + "the router blinks orange and red, " * 12
    previous, refused = None, None
    for _ in range(8):
        try:
            previous = await respond(client, long_question, previous.id if previous else None, instructions=SYSTEM,
                                     max_output_tokens=32)
        except openai.BadRequestError as error:
            refused = error
            break
    assert refused is not None and refused.body["code"] == "context_length_exceeded", refused
    dropped = await respond(client, long_question, previous.id, instructions=SYSTEM, max_output_tokens=32,
                            truncation="auto")
    assert dropped.truncation == "auto" and dropped.output_text
    assert dropped.usage.input_tokens + 32 <= 512
    assert previous.truncation == "disabled"


async def test_prompt_cache_diagnostics_name_a_hit_changed_tools_a_changed_model_and_a_missing_comparison(servers):
    """`prompt_cache_options.comparison_response_id` answered from chatd's own account of the turn's cache: a
    continuation reads the compared response's prompt (a hit); changed tools or another model name miss it, named so
    with the tokens missed; an unknown id is `comparison_response_not_found`. The SDK's types read each one."""
    server, _ = servers
    client = client_for(server)
    tool = {"type": "function", "name": "lookup_line", "description": "Look up a customer's line.",
            "parameters": {"type": "object", "properties": {"line": {"type": "string"}}}}
    first = await respond(client, QUESTIONS[0], instructions=SYSTEM, tools=[tool])

    def compared_with(response_id: str) -> dict:
        return {"prompt_cache_options": {"comparison_response_id": response_id}}

    hit = await respond(client, QUESTIONS[1], first.id, tools=[tool], **compared_with(first.id))
    tools_changed = await respond(client, QUESTIONS[0], instructions=SYSTEM, tools=[{**tool, "name": "check_bill"}],
                                  **compared_with(first.id))
    model_changed = await respond(client, "Which plans do you sell?", instructions="You are the sales desk.",
                                  model="tiny", tools=[tool], **compared_with(first.id))
    missing = await respond(client, QUESTIONS[2], hit.id, tools=[tool], **compared_with("resp_never_made"))
    assert hit.prompt_cache_diagnostics.type == "cache_hit"
    assert hit.prompt_cache_options.comparison_response_id == first.id
    for response, reason in ((tools_changed, "tools_changed"), (model_changed, "model_changed")):
        diagnosis, usage = response.prompt_cache_diagnostics, response.usage
        assert diagnosis.type == "cache_miss" and diagnosis.reason == reason, diagnosis
        assert diagnosis.cache_missed_tokens == usage.input_tokens - usage.input_tokens_details.cached_tokens > 0
        assert diagnosis.comparison_reusable_tokens == first.usage.input_tokens
    assert missing.prompt_cache_diagnostics.type == "comparison_response_not_found"
    assert first.prompt_cache_diagnostics is None, "none unless asked"


async def test_explicit_breakpoints_count_what_is_written_up_to_them_on_both_openai_routes(servers, tiny):
    """`prompt_cache_options.mode: explicit`: usage counts as written only the prompt up to the last
    `prompt_cache_breakpoint` (here the end of the policy), none without one; implicit mode counts all it prefilled.
    A breakpoint's ttl keeps the session ahead of LRU; a fifth breakpoint is refused by name."""
    server, _ = servers
    client = client_for(server)
    policy = SYSTEM + " Refunds take five working days." * 6

    def marked(text: str, part: str) -> list[dict]:
        return [{"type": part, "text": text, "prompt_cache_breakpoint": {"mode": "explicit", "ttl": "12h"}}]

    def policy_tokens(text: str) -> int:
        return len(PromptRenderer(tiny.tokenizer).render([Message("system", text)], add_generation_prompt=False))

    explicit = {"prompt_cache_options": {"mode": "explicit"}}
    chat = await client.chat.completions.create(
        model=MODEL, max_tokens=4, temperature=0, extra_body=explicit,
        messages=[{"role": "system", "content": marked(policy + " Desk A.", "text")},
                  {"role": "user", "content": QUESTIONS[0]}])
    response = await respond(client, [{"role": "developer", "content": marked(policy + " Desk B.", "input_text")},
                                      {"role": "user", "content": QUESTIONS[0]}], **explicit)
    unmarked = await respond(client, QUESTIONS[0], instructions=policy + " Desk C.", **explicit)
    implicit = await respond(client, QUESTIONS[0], instructions=policy + " Desk D.")
    details = chat.usage.prompt_tokens_details
    assert details.cache_write_tokens == policy_tokens(policy + " Desk A.") - details.cached_tokens > 0
    details = response.usage.input_tokens_details
    assert details.cache_write_tokens == policy_tokens(policy + " Desk B.") - details.cached_tokens > 0
    assert details.cache_write_tokens < response.usage.input_tokens - details.cached_tokens
    assert response.prompt_cache_options.mode == "explicit"
    assert unmarked.usage.input_tokens_details.cache_write_tokens == 0
    details = implicit.usage.input_tokens_details
    assert details.cache_write_tokens == implicit.usage.input_tokens - details.cached_tokens
    assert server.engine.call(lambda store: store.stats()).result()["kept_sessions"] >= 2
    with pytest.raises(openai.BadRequestError) as refused:
        await respond(client, [{"role": "user", "content": marked(f"Part {index}.", "input_text")}
                               for index in range(5)])
    assert refused.value.body["param"] == "prompt_cache_breakpoint"


async def test_compact_keeps_the_newest_turns_in_a_window_that_starts_a_new_chain_over_http_and_the_socket(servers):
    """`POST /v1/responses/compact` on a long chain: the window keeps its newest turns (the oldest dropped, as the
    context shift drops them), prefilled with the system prompt read from the cache; a response whose input holds the
    compaction item reads the whole window from the cache and answers as a cacheless server given the same window,
    over HTTP and over the WebSocket mode; a compaction of another key is refused by name."""
    server, reference = servers
    client, solo = client_for(server), client_for(reference)
    tool = {"type": "function", "name": "lookup_line", "parameters": {"type": "object", "properties": {}}}
    previous = None
    for question in QUESTIONS[:6]:
        previous = await respond(client, question, previous.id if previous else None, instructions=SYSTEM,
                                 tools=[tool])
    compacted = await client.responses.compact(model=MODEL, previous_response_id=previous.id)
    assert compacted.object == "response.compaction"
    *kept, compaction = compacted.output
    assert compaction.type == "compaction" and compaction.encrypted_content
    kept_questions = [item.content[0]["text"] if isinstance(item.content[0], dict) else item.content[0].text
                      for item in kept]
    assert 1 <= len(kept_questions) < 6 and kept_questions == QUESTIONS[6 - len(kept_questions):6]
    assert 0 < compacted.usage.input_tokens_details.cached_tokens < compacted.usage.input_tokens, compacted.usage
    sent = [item.model_dump(exclude_none=True, warnings=False) for item in compacted.output]  # (as the SDK reads them)
    after = await respond(client, [*sent, {"role": "user", "content": QUESTIONS[6]}], tools=[tool])
    assert after.usage.input_tokens_details.cached_tokens >= compacted.usage.input_tokens - 1, after.usage
    # The same window, whole, to a server without a cache: the chain's messages from the first kept question on.
    history, point = [], previous
    while point is not None:
        listed = (await client.responses.input_items.list(point.id)).data
        history[:0] = [{"role": "user", "content": listed[-1].content[0].text}, {"role": "assistant",
                                                                                 "content": point.output_text}]
        point = await client.responses.retrieve(point.previous_response_id) if point.previous_response_id else None
    expected = await respond(solo, [*history[-2 * len(kept_questions):], {"role": "user", "content": QUESTIONS[6]}],
                             instructions=SYSTEM, tools=[tool])
    assert after.output_text == expected.output_text
    followed = await respond(client, QUESTIONS[7], after.id, tools=[tool])
    assert followed.usage.input_tokens_details.cached_tokens >= after.usage.input_tokens, "a chain of its own"
    async with client.responses.connect() as connection:
        await connection.response.create(model=MODEL, input=[*sent, {"role": "user", "content": QUESTIONS[6]}],
                                         tools=[tool], max_output_tokens=8, temperature=0)
        async for event in connection:
            if event.type in ("response.completed", "response.incomplete", "error"):
                break
    assert event.type != "error" and event.response.output_text == expected.output_text
    assert event.response.usage.input_tokens_details.cached_tokens >= compacted.usage.input_tokens - 1
    with pytest.raises(openai.BadRequestError) as refused:
        await respond(client, [{"type": "compaction", "encrypted_content": "chatd.window.not-a-session"},
                               {"role": "user", "content": "Hi"}])
    assert refused.value.body["param"] == "input[0].encrypted_content"


@pytest.mark.parametrize("kept_in", ["memory", "redis"])
async def test_deleting_conversation_items_keeps_every_other_id_and_the_cache_up_to_the_edit(tiny, redis_db, kept_in):
    """`DELETE /v1/conversations/{id}/items/{item_id}`: a tool round and a reply's text deleted (the call refused while
    its output is there), every other item keeps its id (and so does the next one added: no id is reused), the
    edit survives a restart on Redis, and the next response reads the history up to the edit from the cache and
    answers as a cacheless server given the edited history."""
    settings = dict(port=0, model=MODEL, verify_sample_rate=0.0) | (
        {"redis_url": redis_db.url} if kept_in == "redis" else {})
    async with ChatServer(Settings(**settings), load=lambda: tiny) as server, \
            ChatServer(Settings(port=0, model=MODEL, session_cache=False), load=lambda: tiny) as reference:
        await server.wait_ready()
        await reference.wait_ready()
        client, solo = client_for(server), client_for(reference)
        conversation = await client.conversations.create(items=[{"role": "system", "content": SYSTEM}])
        first = await respond(client, QUESTIONS[0], conversation=conversation.id)
        await client.conversations.items.create(conversation.id, items=[
            {"role": "user", "content": QUESTIONS[1]},
            {"type": "function_call", "call_id": "call_1", "name": "lookup_line", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "call_1", "output": "{\"status\": \"down\"}"},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "It is down."}]}])
        listed = [item async for item in client.conversations.items.list(conversation.id, order="asc")]
        assert [item.type for item in listed] == ["message", "message", "message", "message", "function_call",
                                                  "function_call_output", "message"]
        call, output, note = listed[4], listed[5], listed[6]
        with pytest.raises(openai.BadRequestError) as refused:
            await client.conversations.items.delete(call.id, conversation_id=conversation.id)
        assert refused.value.body["param"] == "item_id"
        for item in (note, output, call):
            assert (await client.conversations.items.delete(item.id, conversation_id=conversation.id)).id == \
                conversation.id
        with pytest.raises(openai.NotFoundError):
            await client.conversations.items.delete(call.id, conversation_id=conversation.id)
        after = await respond(client, QUESTIONS[2], conversation=conversation.id)
        kept = [item.id async for item in client.conversations.items.list(conversation.id, order="asc")]
        assert kept[:4] == [item.id for item in listed[:4]] and len(kept) == 6
        assert not set(kept[4:]) & {item.id for item in listed}, "a new item never takes a deleted one's id"
        expected = await respond(solo, [{"role": "user", "content": QUESTIONS[0]},
                                        {"role": "assistant", "content": first.output_text},
                                        {"role": "user", "content": QUESTIONS[1]},
                                        {"role": "user", "content": QUESTIONS[2]}], instructions=SYSTEM)
        assert after.output_text == expected.output_text
        assert after.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens, after.usage
    if kept_in == "redis":
        async with ChatServer(Settings(**settings), load=lambda: tiny) as restarted:
            await restarted.wait_ready()
            again = [item.id async for item in client_for(restarted).conversations.items.list(conversation.id,
                                                                                            order="asc")]
        assert again == kept


async def test_prewarm_prefills_without_answering_and_the_next_turn_reads_it(servers):
    """`prompt_cache_options.prewarm`: the policy and the customer's first words are prefilled and nothing is
    generated (`output: []`); a stateless turn that resends them, and a turn continuing the prewarm's id, read them
    from the cache."""
    server, _ = servers
    client = client_for(server)
    policy = SYSTEM + " Technicians visit on weekdays between 8:00 and 18:00." * 3
    opening = [{"role": "user", "content": QUESTIONS[0]}]
    warm = await client.responses.create(model=MODEL, instructions=policy, input=opening,
                                         prompt_cache_options={"prewarm": True})
    assert warm.output == [] and warm.usage.output_tokens == 0 and warm.status == "completed"
    resent = await respond(client, [*opening, {"role": "assistant", "content": "Let me look."},
                                    {"role": "user", "content": QUESTIONS[1]}], instructions=policy, store=False)
    continued = await respond(client, QUESTIONS[1], warm.id)
    for response in (resent, continued):
        assert response.usage.input_tokens_details.cached_tokens >= warm.usage.input_tokens - 1, response.usage
