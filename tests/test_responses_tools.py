"""Function tools and structured output on the Responses API with the real SmolLM2 and real clients: the
`openai` SDK (function_call items, function_call_output continuing by previous_response_id and by conversation,
streamed argument events, text.format json_schema) and the OpenAI Agents SDK running a support agent with two
function tools over several turns; each compared with a server without the session cache, each tool round
prefilling only the tool's results, and bad tool input refused with a 400 naming the parameter."""

from __future__ import annotations

import dataclasses
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import Field

from tests.test_tools_e2e import LOOKUP, MODEL, SYSTEM, TICKET

TOOLS = [{"type": "function", "name": "lookup_order", "description": "Find an order by its id.",
          "parameters": LOOKUP, "strict": True},
         {"type": "function", "name": "open_ticket", "description": "Open a support ticket.",
          "parameters": TICKET, "strict": True}]
SCHEMAS = {tool["name"]: tool["parameters"] for tool in TOOLS}
RESULTS = {"lookup_order": {"status": "lost in transit"}, "open_ticket": {"ticket": "T-88"}}


def _outputs(calls) -> list[dict]:
    return [{"type": "function_call_output", "call_id": call.call_id, "output": json.dumps(RESULTS[call.name])}
            for call in calls]


def _shape(response) -> list[tuple]:
    """A response's output items without their ids: what the model said and called."""
    return [(item.type, getattr(item, "name", None), getattr(item, "arguments", None),
             item.content[0].text if item.type == "message" else None) for item in response.output]


def _calls(response) -> list:
    return [item for item in response.output if item.type == "function_call"]


async def _tool_rounds(client: openai.AsyncOpenAI) -> list:
    """A lookup, a ticket and an answer, each round sending only the outputs of the last one's calls."""
    responses, new_input = [], "My order NW-2231 never arrived and my bill doubled. Please help."
    for choice, limit in (("required", 64), ({"type": "function", "name": "open_ticket"}, 64), ("none", 24)):
        response = await client.responses.create(
            model=MODEL, instructions=SYSTEM, input=new_input, tools=TOOLS, tool_choice=choice,
            parallel_tool_calls=False, max_output_tokens=limit, temperature=0,
            previous_response_id=responses[-1].id if responses else None)
        responses.append(response)
        new_input = _outputs(_calls(response))
    return responses


async def test_function_calls_continue_by_previous_response_id_reading_the_history_from_the_cache(openai_pair):
    client, uncached = openai_pair
    rounds, reference = await _tool_rounds(client), await _tool_rounds(uncached)
    for index, (got, expected) in enumerate(zip(rounds, reference, strict=True)):
        assert [(c.name, c.arguments) for c in _calls(got)] == [(c.name, c.arguments) for c in _calls(expected)]
        assert got.output_text == expected.output_text, index
        if index < 2:
            (call,) = _calls(got)  # parallel_tool_calls false: one call
            assert call.call_id.startswith("call_") and call.id.startswith("fc_") and got.status == "completed"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        else:
            assert not _calls(got) and got.output_text
        if index:
            previous = rounds[index - 1].usage
            assert got.usage.input_tokens_details.cached_tokens >= previous.input_tokens + \
                previous.output_tokens - 1, (index, got.usage)
            assert expected.usage.input_tokens_details.cached_tokens < got.usage.input_tokens_details.cached_tokens
    assert _calls(rounds[1])[0].name == "open_ticket"
    items = (await client.responses.input_items.list(rounds[1].id)).data
    assert [(item.type, item.call_id) for item in items] == [("function_call_output", _calls(rounds[0])[0].call_id)]


async def test_streamed_calls_send_argument_events_and_a_conversation_takes_their_outputs(openai_pair):
    client, _ = openai_pair
    question = "Where is order NW-1010?"
    whole = await client.responses.create(model=MODEL, instructions=SYSTEM, input=question, tools=TOOLS,
                                          tool_choice="required", parallel_tool_calls=False, max_output_tokens=64,
                                          temperature=0, store=False)
    conversation = await client.conversations.create(items=[{"type": "message", "role": "system",
                                                             "content": SYSTEM}])
    kinds, arguments, final = [], "", None
    async for event in await client.responses.create(
            model=MODEL, input=question, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
            max_output_tokens=64, temperature=0, conversation=conversation.id, stream=True):
        kinds.append(event.type)
        if event.type == "response.function_call_arguments.delta":
            arguments += event.delta
        if event.type == "response.completed":
            final = event.response
    (call,) = _calls(final)
    assert (call.name, call.arguments) == (_calls(whole)[0].name, _calls(whole)[0].arguments)
    assert arguments == call.arguments
    assert kinds[-4:] == ["response.function_call_arguments.delta", "response.function_call_arguments.done",
                          "response.output_item.done", "response.completed"]
    assert "response.output_text.delta" not in kinds, "a reply that only calls has no message item"
    answer = await client.responses.create(model=MODEL, input=_outputs([call]), tools=TOOLS, max_output_tokens=32,
                                           temperature=0, conversation=conversation.id)
    assert answer.usage.input_tokens_details.cached_tokens >= final.usage.input_tokens + final.usage.output_tokens - 1
    items = (await client.conversations.items.list(conversation.id, order="asc")).data
    assert [item.type for item in items] == ["message", "message", "function_call", "function_call_output",
                                             "message"]
    assert items[2].call_id == items[3].call_id == call.call_id


async def test_text_format_json_schema_replies_are_valid_and_bad_tool_input_is_refused(openai_pair):
    client, _ = openai_pair
    for question in ["My router blinks red.", "I was charged twice in May."]:
        response = await client.responses.create(
            model=MODEL, instructions="File the customer's problem as a ticket, in JSON.", input=question,
            max_output_tokens=192, temperature=0.8, text={"format": {"type": "json_schema", "name": "ticket",
                                                                     "schema": TICKET, "strict": True}})
        assert response.status == "completed", response.incomplete_details
        jsonschema.validate(json.loads(response.output_text), TICKET)
    orphan = [{"role": "user", "content": "Hi"},
              {"type": "function_call_output", "call_id": "call_nobody", "output": "{}"}]
    cases = [
        (dict(input="Hi", tools=[{"type": "file_search", "vector_store_ids": ["vs_1"]}]), "tools[0].type"),
        (dict(input="Hi", tools=[{"type": "function", "parameters": LOOKUP}]), "tools[0].name"),
        (dict(input="Hi", tools=TOOLS, tool_choice={"type": "function", "name": "refund"}), "tool_choice"),
        (dict(input="Hi", tools=[{**TOOLS[0], "parameters": {"type": "object", "properties": {"a": {"type": 7}}}}]),
         "tools[0].parameters"),
        (dict(input=orphan, tools=TOOLS), "input[1].call_id"),
        (dict(input="Hi", text={"format": {"type": "json_schema", "name": "t", "schema": {"type": 7}}}),
         "text.format.schema"),
        (dict(input="Hi", text={"format": {"type": "json_schema", "name": "t", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}), "text.format"),
        (dict(input="Hi", text={"format": {"type": "grammar"}}), "text.format.type"),
    ]
    for arguments, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.responses.create(model=MODEL, max_output_tokens=4, **arguments)
        assert refused.value.body["param"] == param, (param, refused.value.body)
    first = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:  # no call of that response has this id
        await client.responses.create(model=MODEL, previous_response_id=first.id, max_output_tokens=4, input=[
            {"type": "function_call_output", "call_id": "call_nobody", "output": "{}"}])
    assert refused.value.body["param"] == "input[0].call_id"


async def _support_agent(client: openai.AsyncOpenAI) -> list:
    """Two turns of a support agent with two function tools (the Agents SDK's default Responses API); each
    turn's run resends the whole conversation, as the SDK does."""
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no trace export: nothing leaves this machine
    called: list[tuple[str, dict]] = []

    @function_tool
    def lookup_order(order_id: Annotated[str, Field(pattern=r"^NW-[0-9]{4}$")]) -> str:
        """Find an order by its id (like NW-1234)."""
        called.append(("lookup_order", {"order_id": order_id}))
        return json.dumps(RESULTS["lookup_order"])

    @function_tool
    def open_ticket(category: Literal["billing", "outage", "hardware", "other"],
                    summary: Annotated[str, Field(max_length=80)]) -> str:
        """Open a support ticket about a problem that is not an order."""
        called.append(("open_ticket", {"category": category, "summary": summary}))
        return json.dumps(RESULTS["open_ticket"])

    # `required` for each turn's first round; the SDK resets it to auto once a tool ran, so the agent answers.
    agent = Agent(name="support", instructions=SYSTEM, model=OpenAIResponsesModel(MODEL, client),
                  tools=[lookup_order, open_ticket], model_settings=ModelSettings(
                      temperature=0, tool_choice="required", parallel_tool_calls=False, max_tokens=64))
    first = await Runner.run(agent, "My order NW-2231 never arrived. Please check it.", max_turns=4)
    # The bot's "file a complaint" step: the same agent, held to its ticket tool for that turn's first round.
    filing = agent.clone(model_settings=dataclasses.replace(agent.model_settings, tool_choice="open_ticket"))
    second = await Runner.run(filing, [*first.to_input_list(), {"role": "user", "content": "Thanks. My bill "
                                                                "doubled too: open a billing ticket."}], max_turns=4)
    return [first, second, called]


@pytest.mark.timeout(300)
async def test_the_agents_sdk_runs_a_support_agent_with_two_tools_over_several_turns(openai_pair):
    client, uncached = openai_pair
    first, second, called = await _support_agent(client)
    *reference, reference_calls = await _support_agent(uncached)
    assert called == reference_calls and {name for name, _ in called} <= {"lookup_order", "open_ticket"}
    assert called[0] == ("lookup_order", {"order_id": "NW-2231"})
    assert [name for name, _ in called].count("open_ticket") >= 1
    responses = first.raw_responses + second.raw_responses
    expected = reference[0].raw_responses + reference[1].raw_responses
    assert [_shape(r) for r in responses] == [_shape(r) for r in expected]  # ids aside, token for token
    assert first.final_output == reference[0].final_output and second.final_output == reference[1].final_output
    assert first.final_output and second.final_output
    for before, after in zip(responses, responses[1:], strict=False):  # each round reads all before it from cache
        assert after.usage.input_tokens_details.cached_tokens >= before.usage.input_tokens + \
            before.usage.output_tokens - 1


async def test_allowed_tools_restrict_the_calls_and_keep_every_tool_in_the_prompt(openai_pair):
    """pydantic-ai's way of offering some of the tools for a turn: `tool_choice: allowed_tools`. Every call made is
    an allowed one, on both OpenAI routes, and the prompt is the one with every tool (its cache stays valid whichever
    subset a turn allows)."""
    client, _ = openai_pair
    question = "My order NW-2231 never arrived. Look it up please."
    allowed = {"type": "allowed_tools", "mode": "required", "tools": [{"type": "function", "name": "open_ticket"}]}
    restricted = await client.responses.create(model=MODEL, instructions=SYSTEM, input=question, tools=TOOLS,
                                               tool_choice=allowed, parallel_tool_calls=False, max_output_tokens=64,
                                               temperature=0, store=False)
    free = await client.responses.create(model=MODEL, instructions=SYSTEM, input=question, tools=TOOLS,
                                         tool_choice="required", parallel_tool_calls=False, max_output_tokens=1,
                                         temperature=0, store=False)
    assert [call.name for call in _calls(restricted)] == ["open_ticket"]
    jsonschema.validate(json.loads(_calls(restricted)[0].arguments), TICKET)
    assert restricted.usage.input_tokens == free.usage.input_tokens
    chat_tools = [{"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")}}
                  for tool in TOOLS]
    completion = await client.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        tools=chat_tools, parallel_tool_calls=False, max_tokens=64, temperature=0,
        tool_choice={"type": "allowed_tools", "allowed_tools": {
            "mode": "required", "tools": [{"type": "function", "function": {"name": "open_ticket"}}]}})
    assert [call.function.name for call in completion.choices[0].message.tool_calls] == ["open_ticket"]
    with pytest.raises(openai.BadRequestError) as refused:
        await client.responses.create(model=MODEL, input=question, tools=TOOLS, tool_choice={
            "type": "allowed_tools", "mode": "auto", "tools": [{"type": "function", "name": "refund"}]})
    assert refused.value.body["param"] == "tool_choice"


async def test_a_call_cut_by_the_token_limit_is_never_text_on_the_openai_routes(openai_pair):
    """A call the token limit cuts while it is written ends `length` (Responses: `incomplete`) with no call and none
    of its markup, streamed or not; the next turn, sent back as the client holds it, answers as a cacheless server."""
    client, uncached = openai_pair
    question = "Where is my order NW-2231? It never arrived."
    chat_tools = [{"type": "function", "function": {key: tool[key] for key in ("name", "description", "parameters")}}
                  for tool in TOOLS]
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    chat = dict(model=MODEL, messages=messages, tools=chat_tools, tool_choice="required", max_tokens=6,
                temperature=0)
    cut = await client.chat.completions.create(**chat)
    assert cut.choices[0].finish_reason == "length" and not cut.choices[0].message.tool_calls
    text = cut.choices[0].message.content or ""
    streamed, finish = [], None
    async for chunk in await client.chat.completions.create(stream=True, **chat):
        for choice in chunk.choices:
            streamed.append(choice.delta.content or "")
            assert not choice.delta.tool_calls
            finish = choice.finish_reason or finish
    assert finish == "length" and "".join(streamed) == text
    for reply in (text, "".join(streamed)):
        assert "<tool_call>" not in reply and "lookup_order" not in reply and "{" not in reply, reply
    responses = dict(model=MODEL, instructions=SYSTEM, input=question, tools=TOOLS, tool_choice="required",
                     max_output_tokens=6, temperature=0)
    response = await client.responses.create(**responses)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert not _calls(response) and "<tool_call>" not in response.output_text and "{" not in response.output_text
    events = [event async for event in await client.responses.create(stream=True, **responses)]
    assert events[-1].type == "response.incomplete" and not _calls(events[-1].response)
    assert not any(event.type.startswith("response.function_call") for event in events)
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == events[-1].response.output_text == response.output_text
    follow = messages + [{"role": "assistant", "content": text}, {"role": "user", "content": "Please just answer."}]
    answers = [await each.chat.completions.create(model=MODEL, messages=follow, max_tokens=16, temperature=0)
               for each in (client, uncached)]
    assert answers[0].choices[0].message.content == answers[1].choices[0].message.content


# What OpenAI's spec requires of every response object (typed clients that validate responses reject one without).
REQUIRED = {"id", "object", "created_at", "status", "error", "incomplete_details", "instructions", "model", "output",
            "parallel_tool_calls", "metadata", "tool_choice", "tools", "temperature", "top_p", "usage", "completed_at",
            "truncation", "presence_penalty", "frequency_penalty", "top_logprobs", "reasoning", "max_tool_calls",
            "background", "service_tier", "safety_identifier", "prompt_cache_key", "max_output_tokens",
            "previous_response_id", "text", "user", "store"}


async def test_every_response_object_has_what_the_spec_requires(openai_pair):
    """A plain, a streamed, a tool and an incomplete reply, read raw: every required field, echoed tools with
    `strict`, and the SDK's own model reads each."""
    client, _ = openai_pair
    bodies = []
    async with httpx.AsyncClient(base_url=str(client.base_url), timeout=120) as http:
        for extra in ({"input": "Say hello.", "max_output_tokens": 64},
                      {"input": "Where is NW-2231?", "tools": TOOLS, "tool_choice": "required",
                       "max_output_tokens": 64, "prompt_cache_key": "desk-7", "safety_identifier": "user-1"},
                      {"input": "Tell me a long story about routers.", "max_output_tokens": 4}):
            response = await http.post("responses", json={"model": MODEL, "temperature": 0, **extra})
            assert response.status_code == 200, response.text
            bodies.append(response.json())
        async with http.stream("POST", "responses", json={"model": MODEL, "input": "Say hello.", "stream": True,
                                                          "max_output_tokens": 64, "temperature": 0}) as stream:
            events = [json.loads(line.removeprefix("data: ")) async for line in stream.aiter_lines()
                      if line.startswith("data: ")]
        bodies += [event["response"] for event in events if "response" in event]
    statuses = {body["status"] for body in bodies}
    assert {"completed", "incomplete", "in_progress"} <= statuses
    for body in bodies:
        assert REQUIRED <= set(body), REQUIRED - set(body)
        assert all(tool["strict"] is True for tool in body["tools"])
        assert (body["completed_at"] is not None) == (body["status"] == "completed")
        openai.types.responses.Response.model_validate(body)
    assert bodies[1]["prompt_cache_key"] == "desk-7" and bodies[1]["safety_identifier"] == "user-1"
    assert bodies[1]["output"][0]["type"] == "function_call"
