"""The OpenAI-compatible API with the tiny model: the official `openai` client, the raw SSE wire
format, typed errors, isolation between keys, branches and a hung client."""

from __future__ import annotations

import asyncio
import json
import logging

import httpx
import openai
import pytest

from chatd.api.server import ChatServer
from chatd.config import Settings

MODEL = "tiny-test"
SYSTEM = "You are a helpful support agent."


def client_for(server: ChatServer, key: str = "none") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key=key, max_retries=0)


async def ask(client: openai.AsyncOpenAI, messages: list[dict], max_tokens: int = 8, **extra):
    """One streamed completion: (text, final usage, the session header)."""
    async with client.chat.completions.with_streaming_response.create(
            model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True}, **extra) as response:
        text, usage = [], None
        async for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line.removeprefix("data: "))
                if chunk["choices"]:
                    text.append(chunk["choices"][0]["delta"].get("content") or "")
                else:
                    usage = chunk["usage"]
        return "".join(text), usage, response.headers["X-Chatd-Session-Id"]


@pytest.fixture
async def server(tiny):
    async with ChatServer(Settings(port=0, model=MODEL, verify_sample_rate=0.0), load=lambda: tiny) as running:
        await running.wait_ready()
        yield running


async def test_models_and_a_stateless_conversation_reuses_its_cache(server):
    client = client_for(server)
    models = await client.models.list()
    assert [model.id for model in models.data] == [MODEL] and models.data[0].object == "model"
    messages = [{"role": "system", "content": SYSTEM}]
    sessions = set()
    for turn, content in enumerate(["My router blinks.", "It is orange.", "Still orange.", "Thanks!"]):
        messages.append({"role": "user", "content": [{"type": "text", "text": content}]})  # parts, as some send
        reply, usage, session_id = await ask(client, messages)
        messages.append({"role": "assistant", "content": reply})
        sessions.add(session_id)
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        if turn >= 1:  # everything but the new message comes from the session's cache
            assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.6 * usage["prompt_tokens"], usage
    assert len(sessions) == 1  # every request continued the same session
    completion = await client.chat.completions.create(model=MODEL, messages=messages + [
        {"role": "user", "content": "One more thing."}], max_tokens=5, temperature=0)
    assert completion.object == "chat.completion" and completion.choices[0].finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens_details.cached_tokens > 0


async def test_the_raw_wire_format(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 4,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            assert response.headers["x-chatd-session-id"]
            raw = (await response.aread()).decode()
        events = raw.split("\n\n")
        assert events[-1] == "" and events[-2] == "data: [DONE]"
        chunks = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
        assert all(event.startswith("data: ") for event in events[:-1])
        assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
        assert all(c["usage"] is None for c in chunks[:-1])
        assert chunks[-2]["choices"][0]["finish_reason"] in ("stop", "length")
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] >= 1
        assert "cached_tokens" in chunks[-1]["usage"]["prompt_tokens_details"]

        body["stream"] = False
        del body["stream_options"]
        plain = await http.post("/v1/chat/completions", json=body)
        assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0
        bad = await http.post("/v1/chat/completions", content=b"{not json",
                              headers={"Content-Type": "application/json"})
        assert bad.status_code == 400 and set(bad.json()["error"]) == {"message", "type", "param", "code"}
        missing = await http.post("/v1/chat/completions", json={"model": MODEL})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
        assert (await http.get("/docs")).status_code == 200  # FastAPI's OpenAPI page
        assert (await http.get("/healthz")).status_code == 200  # still served beside the API
        no_events = await http.get("/kv/blocks")
        assert no_events.status_code == 404 and "--kv-events-endpoint" in no_events.json()["error"]["message"]
        metrics = (await http.get("/metrics")).text
        assert 'chatd:api_requests_total{api="openai",model_name="tiny-test"} 2.0' in metrics
        assert 'chatd:api_requests_total{api="websocket",model_name="tiny-test"} 0.0' in metrics


async def test_typed_errors(tiny):
    settings = Settings(port=0, model=MODEL, api_key=["alpha-key"], rate_limit_per_min=2)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        good, messages = client_for(server, "alpha-key"), [{"role": "user", "content": "Hi"}]
        with pytest.raises(openai.AuthenticationError):
            await client_for(server, "wrong-key").chat.completions.create(model=MODEL, messages=messages)
        with pytest.raises(openai.NotFoundError) as unknown:
            await good.chat.completions.create(model="gpt-4o", messages=messages)
        assert unknown.value.body["param"] == "model"
        tool = {"type": "function", "function": {"name": "f"}}
        for refused, param in [({"n": 2}, "n"), ({"tools": [tool], "tool_choice": {
                "type": "function", "function": {"name": "g"}}}, "tool_choice"), ({"logprobs": True}, "logprobs"),
                               ({"response_format": {"type": "json_schema", "json_schema": {
                                   "name": "x", "schema": {"type": "objekt"}}}}, "response_format.json_schema.schema")]:
            with pytest.raises(openai.BadRequestError) as bad:
                await good.chat.completions.create(model=MODEL, messages=messages, **refused)
            assert bad.value.body["param"] == param
        harmless = {"frequency_penalty": 0, "presence_penalty": 0, "logit_bias": {}, "user": "u-1"}
        await good.chat.completions.create(model=MODEL, messages=messages, max_tokens=2, **harmless)
        await good.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        with pytest.raises(openai.RateLimitError) as limited:
            await good.chat.completions.create(model=MODEL, messages=messages, max_tokens=2)
        assert int(limited.value.response.headers["Retry-After"]) >= 1


async def test_another_key_never_reuses_a_cache(tiny):
    settings = Settings(port=0, model=MODEL, api_key=["key-a", "key-b", "key-c"], verify_sample_rate=0.0)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        a, b = client_for(server, "key-a"), client_for(server, "key-b")
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My order is late."}]
        reply, _, session_a = await ask(a, messages)
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": "Order 1234."}]
        _, usage_a, again = await ask(a, messages)
        assert again == session_a and usage_a["prompt_tokens_details"]["cached_tokens"] > 0
        _, usage_b, session_b = await ask(b, messages)  # B sends A's exact history
        assert session_b != session_a
        assert usage_b["prompt_tokens_details"]["cached_tokens"] == 0  # not even the shared system prompt
        c = client_for(server, "key-c")
        _, usage_c, pinned = await ask(c, messages, extra_headers={"X-Session-Id": session_a})
        assert pinned not in (session_a, session_b)  # naming A's session is a hint C has no right to: ignored
        assert usage_c["prompt_tokens_details"]["cached_tokens"] == 0


async def test_two_branches_of_one_prefix_each_equal_a_run_without_cache(tiny):
    async with ChatServer(Settings(port=0, model=MODEL, verify_sample_rate=0.0), load=lambda: tiny) as server, \
            ChatServer(Settings(port=0, model=MODEL, session_cache=False), load=lambda: tiny) as reference:
        for running in (server, reference):
            await running.wait_ready()
        cached, uncached = client_for(server), client_for(reference)
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My bill is wrong."}]
        reply, _, first = await ask(cached, messages)
        messages.append({"role": "assistant", "content": reply})
        branches = [messages + [{"role": "user", "content": text}] for text in ("Refund me.", "Explain it.")]
        results = await asyncio.gather(*(ask(cached, branch, max_tokens=12) for branch in branches))
        sessions = {session for _, _, session in results}
        assert len(sessions) == 2 and first in sessions  # one continued the session, the other branched
        for branch, (text, usage, _) in zip(branches, results, strict=True):
            expected, _, _ = await ask(uncached, branch, max_tokens=12)
            assert text == expected
            assert usage["prompt_tokens_details"]["cached_tokens"] > 0  # the branch started from a copy
        regenerated, usage, session = await ask(cached, branches[0], max_tokens=12)  # "regenerate"
        assert regenerated == results[0][0] and usage["prompt_tokens_details"]["cached_tokens"] > 0


async def test_a_hung_client_does_not_hold_the_session(server):
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story."}], "max_tokens": 300,
            "temperature": 0, "stream": True}
    reader, writer = await asyncio.open_connection("127.0.0.1", server.port)
    payload = json.dumps(body).encode()
    writer.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload)
    await writer.drain()
    head = await reader.readuntil(b"\r\n\r\n")
    session_id = next(line.split(b": ", 1)[1].decode() for line in head.split(b"\r\n")
                      if line.lower().startswith(b"x-chatd-session-id"))
    await reader.readuntil(b"\n\n")  # the first event, then read no more and keep the connection open
    for _ in range(600):
        session = await server.sessions.get(session_id)
        if session.turns == 1:
            break
        await asyncio.sleep(0.05)
    assert session.turns == 1  # the reply was recorded while the client read nothing
    assert not server.turns.is_claimed(session_id)  # and the session is free
    writer.close()


async def test_a_failure_mid_stream_is_one_error_event(tiny):
    settings = Settings(port=0, model=MODEL, enable_fault_injection=True, verify_sample_rate=0.0)
    async with ChatServer(settings, load=lambda: tiny) as server, \
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
        await server.wait_ready()
        assert (await http.post("/admin/engine/fault?stage=decode")).status_code == 200  # the next decode step fails
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 20,
                "temperature": 0, "stream": True}
        async with http.stream("POST", "/v1/chat/completions", json=body) as response:
            assert response.status_code == 200  # the first token came from the prefill, before the failure
            events = [event for event in (await response.aread()).decode().split("\n\n") if event]
        assert events[0].startswith("data: ") and "[DONE]" not in events[-1]
        error = json.loads(events[-1].removeprefix("data: "))["error"]
        assert error["type"] == "server_error" and "decode" in error["message"]
        after = await http.post("/v1/chat/completions", json={**body, "stream": False})  # the server goes on
        assert after.status_code == 200 and after.json()["choices"][0]["message"]["content"] is not None


async def test_a_cap_above_the_servers_limit_stops_there_and_null_means_the_default(tiny):
    """Clients ask for more tokens than a server gives (the AI SDK 4096, litellm 128000) and send null for
    parameters they leave out: the reply stops at --max-new-tokens with `length` (`max_tokens` for Anthropic), and a
    request without a cap generates up to that limit too, not a smaller default."""
    settings = Settings(port=0, model=MODEL, verify_sample_rate=0.0, max_new_tokens=12)
    async with ChatServer(settings, load=lambda: tiny) as server:
        await server.wait_ready()
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
            nulls = {"temperature": None, "top_p": None, "n": None, "frequency_penalty": None,
                     "presence_penalty": None, "parallel_tool_calls": None, "stream": None}
            for cap in ({"max_tokens": 128000}, {"max_completion_tokens": 4096}, {}):
                response = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": f"Hello {cap}"}], **cap, **nulls})
                assert response.status_code == 200, response.text
                body = response.json()
                assert body["usage"]["completion_tokens"] <= 12
                assert body["choices"][0]["finish_reason"] in ("length", "stop")
            for cap in ({"max_output_tokens": 4096}, {}):
                response = await http.post("/v1/responses", json={
                    "model": MODEL, "input": f"Hello {cap}", "store": None, "temperature": None, "top_p": None,
                    "parallel_tool_calls": None, **cap})
                assert response.status_code == 200, response.text
                assert response.json()["usage"]["output_tokens"] <= 12
            response = await http.post("/v1/messages", json={"model": MODEL, "max_tokens": 128000, "messages": [
                {"role": "user", "content": "Hello"}]})
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["output_tokens"] <= 12
            for bad in ({"max_tokens": 0}, {"temperature": 3}):  # still refused: below 1, out of range
                response = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": [{"role": "user", "content": "Hello"}], **bad})
                assert response.status_code == 400, response.text
        # The tiny model never ends a reply of its own: a reply that reached the limit says so.
        client = client_for(server)
        completion = await client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                          max_tokens=5000, temperature=0)
        assert completion.usage.completion_tokens == 12 and completion.choices[0].finish_reason == "length"


async def test_models_by_id_and_unknown_routes_answer_in_the_apis_shape(server, caplog):
    """`GET /v1/models/{id}` (the SDK's `models.retrieve`); a path or method chatd does not serve is an error body
    the client's SDK parses (OpenAI's, Anthropic's under /v1/messages), each refusal logged once with its route."""
    caplog.set_level(logging.INFO, logger="chatd.api.http_errors")
    client = client_for(server)
    assert (await client.models.retrieve(MODEL)).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        await client.models.retrieve("gpt-9")
    assert missing.value.body["code"] == "model_not_found"
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
        wrong_method = await http.put("/v1/responses")
        assert wrong_method.status_code == 405
        assert wrong_method.json()["error"]["code"] == "method_not_allowed"
        assert "POST" in wrong_method.json()["error"]["message"]
        nowhere = await http.post("/v1/nothing/here", json={})
        assert nowhere.status_code == 404 and nowhere.json()["error"]["type"] == "not_found_error"
        anthropic = await http.get("/v1/messages/unknown")
        assert anthropic.status_code in (404, 405) and anthropic.json()["type"] == "error"
        page = await http.get("/no-such-page")
        assert page.status_code == 404 and "/dashboard" in page.text and "/v1/responses" in page.text
    refusals = [record.getMessage() for record in caplog.records if "refused" in record.getMessage()]
    assert any("PUT /v1/responses refused: 405 method_not_allowed" in line for line in refusals), refusals
    assert any("GET /v1/models/gpt-9 refused: 404 model_not_found" in line for line in refusals), refusals


async def test_prompt_cache_key_finds_its_own_conversation_first_on_any_worker(tiny, redis_db):
    """Two customers' identical conversations, each under its own `prompt_cache_key`: each key's next request, on
    either worker and on either OpenAI route, continues the session its key last ran in."""
    settings = Settings(port=0, model=MODEL, verify_sample_rate=0.0, redis_url=redis_db.url)
    async with ChatServer(settings, load=lambda: tiny) as one, ChatServer(settings, load=lambda: tiny) as two:
        await one.wait_ready()
        await two.wait_ready()
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "My router blinks."}]
        sessions, replies = {}, {}
        for key in ("desk-a", "desk-b"):
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{one.port}") as http:
                response = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0, "prompt_cache_key": key})
            sessions[key] = response.headers["x-chatd-session-id"]
            replies[key] = response.json()["choices"][0]["message"]["content"]
        assert replies["desk-a"] == replies["desk-b"] and sessions["desk-a"] != sessions["desk-b"]
        follow = messages + [{"role": "assistant", "content": replies["desk-a"]}, {"role": "user", "content": "Now?"}]
        for key in ("desk-a", "desk-b"):  # (the index alone would offer the later one, desk-b's, first)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{two.port}") as http:
                response = await http.post("/v1/chat/completions", json={
                    "model": MODEL, "messages": follow, "max_tokens": 4, "temperature": 0, "prompt_cache_key": key})
            assert response.headers["x-chatd-session-id"] == sessions[key], key
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{one.port}") as http:
            response = await http.post("/v1/responses", json={
                "model": MODEL, "instructions": SYSTEM, "max_output_tokens": 4, "temperature": 0,
                "prompt_cache_key": "desk-c", "input": [{"role": "user", "content": "My router blinks."}]})
            first = response.headers["x-chatd-session-id"]
            text = response.json()["output"][0]["content"][0]["text"]
            response = await http.post("/v1/responses", json={
                "model": MODEL, "instructions": SYSTEM, "max_output_tokens": 4, "temperature": 0, "store": False,
                "prompt_cache_key": "desk-c", "input": [{"role": "user", "content": "My router blinks."},
                                                        {"role": "assistant", "content": text},
                                                        {"role": "user", "content": "Now?"}]})
            assert response.headers["x-chatd-session-id"] == first


async def test_a_request_continues_the_session_sharing_the_longest_token_prefix_whatever_its_tools(server):
    """A support chat whose second turn offers tools (the model calls one) and whose tool result is sent without
    `tools` (the prompt is then rendered without them, as the first turn's was): the tools turn shares only the start
    of the system prompt with the first turn's session, so it branches rather than throw that cache away, and the
    tool result (whose messages the tools turn's session holds, but which shares more with the first turn's)
    branches from the first turn's session, reading that whole turn from the cache."""
    client = client_for(server)
    tools = [{"type": "function", "function": {"name": "lookup_line", "parameters": {"type": "object",
                                                                                     "properties": {}}}}]
    policy = SYSTEM + " Check the customer's line before answering anything about an outage, and be brief." * 2
    first = [{"role": "system", "content": policy}, {"role": "user", "content": "My internet is down again today."}]
    reply = await client.chat.completions.create(model=MODEL, messages=first, max_tokens=12, temperature=0)
    second = [*first, {"role": "assistant", "content": reply.choices[0].message.content},
              {"role": "user", "content": "Please check my line."}]
    called = await client.chat.completions.create(model=MODEL, messages=second, max_tokens=96, temperature=0,
                                                  tools=tools, tool_choice="required")
    call = called.choices[0].message.tool_calls[0]
    third = [*second, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "{\"status\": \"down since 9:00\"}"}]
    text, usage, _ = await ask(client, third)
    assert text
    assert usage["prompt_tokens_details"]["cached_tokens"] >= reply.usage.prompt_tokens + \
        reply.usage.completion_tokens - 1, usage
