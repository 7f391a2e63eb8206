"""Tools and structured outputs with the real SmolLM2 and real clients (the `openai` SDK, LangChain): calls
that validate against their schemas, streamed as the SDK assembles them, a tool round that prefills only the
tool's result, replies equal to a server without the session cache, JSON replies valid for their schema, and
every bad tool input a 400 naming the parameter."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Literal

import httpx
import jsonschema
import openai
import pytest

from chatd.api.server import ChatServer
from chatd.config import Settings
from tests.support import openai_client

MODEL = "smollm2-135m"
SYSTEM = "You are the support assistant of Northwind Telecom. Use the tools to look things up."
LOOKUP = {"type": "object", "properties": {"order_id": {"type": "string", "pattern": "^NW-[0-9]{4}$"}},
          "required": ["order_id"], "additionalProperties": False}
TICKET = {"type": "object", "properties": {
    "category": {"type": "string", "enum": ["billing", "outage", "hardware", "other"]},
    "priority": {"type": "integer", "minimum": 1, "maximum": 4}, "summary": {"type": "string", "maxLength": 80}},
    "required": ["category", "priority", "summary"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "lookup_order", "description": "Find an order by its id.",
                                           "parameters": LOOKUP, "strict": True}},
         {"type": "function", "function": {"name": "open_ticket", "description": "Open a support ticket.",
                                           "parameters": TICKET, "strict": True}}]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}


async def _agent_loop(client: openai.AsyncOpenAI) -> list:
    """Two tool rounds and an answer, as an agent runs them: the results of each call go back to the model."""
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": "My order NW-2231 never arrived and my bill doubled. Please help."}]
    completions = []
    for choice, limit in (("required", 64), ({"type": "function", "function": {"name": "open_ticket"}}, 64),
                          ("none", 24)):
        completion = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                          tool_choice=choice, max_tokens=limit, temperature=0)
        completions.append(completion)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or ():
            result = {"lookup_order": {"status": "lost in transit", "eta": None},
                      "open_ticket": {"ticket": "T-88", "queue": "billing"}}.get(call.function.name, {})
            messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(result)})
    return completions


@dataclass
class DeskLoops:
    first: list  # a desk's first agent loop, on a server with the session cache and drafts
    second: list  # its second, drafted from the first's replies (the desk's past replies)
    plain: list  # the same loop on a server with neither the session cache nor drafts
    speculation: dict  # the first server's drafting counts after both


@pytest.fixture(scope="module")
def desk_loops(smollm2) -> DeskLoops:
    """The agent loop twice on one server and once on a plain one: what the next two tests check, run once."""

    async def run() -> DeskLoops:
        async with ChatServer(Settings(port=0), load=lambda: smollm2) as server, \
                ChatServer(Settings(port=0, session_cache=False, speculation="off"), load=lambda: smollm2) as plain:
            await server.wait_ready()
            await plain.wait_ready()
            async with openai_client(server) as client, openai_client(plain) as reference:
                first, second, expected = await _agent_loop(client), await _agent_loop(client), \
                    await _agent_loop(reference)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}") as http:
                speculation = (await http.get("/v1/stats")).json()["now"]["engine"]["speculation"]
        return DeskLoops(first, second, expected, speculation)

    return asyncio.run(run())


def test_an_agent_loop_calls_valid_functions_and_each_round_prefills_only_the_tool_results(desk_loops):
    rounds, reference = desk_loops.first, desk_loops.plain
    for index, (got, expected) in enumerate(zip(rounds, reference, strict=True)):
        message = got.choices[0].message
        assert message.model_dump(exclude={"tool_calls"}) == expected.choices[0].message.model_dump(
            exclude={"tool_calls"}), f"round {index}"
        assert [(c.function.name, c.function.arguments) for c in message.tool_calls or ()] == \
            [(c.function.name, c.function.arguments) for c in expected.choices[0].message.tool_calls or ()]
        if index < 2:
            assert got.choices[0].finish_reason == "tool_calls" and message.tool_calls
            for call in message.tool_calls:
                assert call.id.startswith("call_")
                jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
        else:
            assert got.choices[0].finish_reason in ("stop", "length") and not message.tool_calls
        if index:
            previous = rounds[index - 1].usage
            # The history up to the last reply comes from the cache: only the tool results and the template's
            # new tokens are prefilled.
            assert got.usage.prompt_tokens_details.cached_tokens >= previous.prompt_tokens + \
                previous.completion_tokens - 1, (index, got.usage)
            assert expected.usage.prompt_tokens_details.cached_tokens < got.usage.prompt_tokens_details.cached_tokens
    assert rounds[1].choices[0].message.tool_calls[0].function.name == "open_ticket"


def test_tool_calls_drafted_from_the_desks_past_replies_equal_plain_decoding(desk_loops):
    """A second agent loop's calls and answer are drafted from the first's (the desk's past replies) and verified
    under the tools' grammar: every round equals a server's without speculation, and drafts were accepted."""
    drafted, expected, speculation = desk_loops.second, desk_loops.plain, desk_loops.speculation
    for index, (got, want) in enumerate(zip(drafted, expected, strict=True)):
        assert got.choices[0].message.model_dump(exclude={"tool_calls"}) == want.choices[0].message.model_dump(
            exclude={"tool_calls"}), f"round {index}"
        assert [(c.function.name, c.function.arguments) for c in got.choices[0].message.tool_calls or ()] == \
            [(c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls or ()]
        assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert drafted[0].choices[0].message.tool_calls, "the first round called a tool"
    assert speculation["accepted_tokens"] > 0, speculation


async def test_streamed_calls_assemble_as_the_sdk_reads_them(openai_pair):
    client, _ = openai_pair
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Where is order NW-1010?"}]
    whole = await client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS,
                                                 tool_choice="required", max_tokens=64, temperature=0)
    async with client.chat.completions.stream(model=MODEL, messages=messages, tools=TOOLS, tool_choice="required",
                                              max_tokens=64, temperature=0) as stream:
        kinds = [event.type async for event in stream]
        streamed = await stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert streamed.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in streamed.choices[0].message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls]


async def test_json_schema_replies_are_valid_for_their_schema(openai_pair):
    client, _ = openai_pair
    for index, question in enumerate(["My router blinks red.", "I was charged twice in May.",
                                      "The phone I bought has a cracked screen."]):
        completion = await client.chat.completions.create(
            model=MODEL, max_tokens=96, temperature=0.8, seed=index, messages=[
                {"role": "system", "content": "File the customer's problem as a ticket, in JSON."},
                {"role": "user", "content": question}],
            response_format={"type": "json_schema", "json_schema": {"name": "ticket", "schema": TICKET,
                                                                    "strict": True}})
        assert completion.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(completion.choices[0].message.content), TICKET)
    plain = await client.chat.completions.create(model=MODEL, max_tokens=48, temperature=0, messages=[
        {"role": "user", "content": "Reply in JSON: what is your name?"}], response_format={"type": "json_object"})
    # Any object: the small model may nest keys until max_tokens, which it then says (never "stop" on broken JSON).
    content, finish = plain.choices[0].message.content, plain.choices[0].finish_reason
    assert content.startswith("{") and (finish == "length" or isinstance(json.loads(content), dict)), (finish, content)


async def test_bad_tool_input_is_a_400_naming_the_parameter_before_any_model_work(openai_pair):
    client, _ = openai_pair
    user = [{"role": "user", "content": "Hi"}]
    orphan = [*user, {"role": "assistant", "content": "Let me look."},
              {"role": "tool", "tool_call_id": "call_nobody", "content": "{}"}]
    huge = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "x" * 200}
                                             for i in range(2000)}}
    cases = [
        (dict(messages=user, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "refund"}}),
         "tool_choice"),
        (dict(messages=user, tool_choice="required"), "tool_choice"),
        (dict(messages=orphan, tools=TOOLS), "messages[2]"),
        (dict(messages=user, tools=[{"type": "function", "function": {"description": "no name"}}]),
         "tools[0].function.name"),
        (dict(messages=user, tools=[{"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"type": 7}}}}}]), "tools[0].parameters"),
        (dict(messages=user, tools=[{"type": "function", "function": {"name": "f", "parameters": huge}}]),
         "tools[0].parameters"),
        (dict(messages=user, response_format={"type": "json_schema", "json_schema": {"name": "t", "schema": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}}}), "response_format"),
    ]
    for arguments, param in cases:
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, max_tokens=4, **arguments)
        assert refused.value.body["param"].startswith(param), (param, refused.value.body)
    assert (await client.chat.completions.create(model=MODEL, messages=user, max_tokens=4)).choices, \
        "the server goes on serving"


async def test_langchain_binds_tools_and_returns_structured_output(openai_pair, smollm2):
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    client, _ = openai_pair
    chat = ChatOpenAI(model=MODEL, base_url=str(client.base_url), api_key="unused", temperature=0, max_tokens=128)

    class OpenTicket(BaseModel):
        """Open a support ticket."""

        category: Literal["billing", "outage", "hardware", "other"]
        priority: int = Field(ge=1, le=4)

    bound = chat.bind_tools([OpenTicket], tool_choice="OpenTicket")
    history = [SystemMessage(SYSTEM), HumanMessage("My internet is down since this morning.")]
    called = await bound.ainvoke(history)
    assert called.tool_calls and called.tool_calls[0]["name"] == "OpenTicket"
    OpenTicket.model_validate(called.tool_calls[0]["args"])
    answer = await chat.bind_tools([OpenTicket]).ainvoke([*history, called, ToolMessage(
        '{"ticket": "T-12"}', tool_call_id=called.tool_calls[0]["id"])])
    assert answer.response_metadata["finish_reason"] in ("stop", "length", "tool_calls")
    assert answer.usage_metadata["input_token_details"]["cache_read"] > 0, "the tool round continued its cache"
    ticket = await chat.with_structured_output(OpenTicket, method="json_schema").ainvoke(history)
    assert isinstance(ticket, OpenTicket) and 1 <= ticket.priority <= 4
