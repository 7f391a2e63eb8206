"""A support agent on OpenAI's Responses WebSocket mode (`client.responses.connect()`), served by chatd: one socket
for the whole conversation. The policy and tools are prefilled before the customer writes (`generate: false`), each
turn sends only what is new (the customer's message, or the tools' results) with `previous_response_id`, and chatd
runs it as the next turn of the session that holds the cache, so only that is prefilled (`cached_tokens` says how
much of the prompt was read from the cache). The SDK reconnects when a worker drains (close code 1001).

    make run   # in another terminal: serves SmolLM2-135M on 127.0.0.1:8765
    .venv/bin/python examples/responses_ws_agent.py
"""

from __future__ import annotations

import asyncio
import json
import sys

import openai

MODEL = "smollm2-135m"
POLICY = ("You are the support assistant of Northwind Telecom. Orders ship within two days; refunds take five "
          "working days. Use the tools to look orders up. Answer in one or two short sentences.")
ORDERS = {"NW-2231": {"status": "lost in transit", "refund": "possible"}}
TOOLS = [{"type": "function", "name": "lookup_order", "description": "Find an order by its id (NW- and four digits)",
          "parameters": {"type": "object", "properties": {"order_id": {"type": "string"}},
                         "required": ["order_id"]}}]
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


async def respond(connection, **fields):
    """Send one `response.create` and print its text as it streams; the final event."""
    await connection.response.create(model=MODEL, temperature=0, max_output_tokens=96, **fields)
    async for event in connection:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
        if event.type in ENDS:
            print()
            return event
    raise ConnectionError("the socket closed")


def tool_outputs(response) -> list[dict]:
    """Run the calls the reply made; their results, as the next create's input."""
    return [{"type": "function_call_output", "call_id": item.call_id,
             "output": json.dumps(ORDERS.get(json.loads(item.arguments).get("order_id"), {"status": "unknown"}))}
            for item in response.output if item.type == "function_call"]


async def main(url: str) -> None:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused-without-keys")
    async with client.responses.connect(on_reconnecting=lambda event: print(f"(reconnecting: {event.close_code})"))\
            as connection:
        warm = await respond(connection, instructions=POLICY, tools=TOOLS, input=[], generate=False)
        previous = warm.response
        for message in ("Hi, my order NW-2231 never arrived.", "Can I get a refund then?"):
            print(f"customer: {message}\nagent: ", end="")
            end = await respond(connection, tools=TOOLS, input=message, previous_response_id=previous.id)
            while end.type == "response.completed" and (outputs := tool_outputs(end.response)):
                end = await respond(connection, tools=TOOLS, input=outputs, previous_response_id=end.response.id)
            if end.type in ("error", "response.failed"):
                sys.exit(f"failed: {end}")
            previous = end.response
            read, prompt = previous.usage.input_tokens_details.cached_tokens, previous.usage.input_tokens
            print(f"  ({read} of {prompt} prompt tokens from the cache)")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1] if len(sys.argv) > 1 else "http://127.0.0.1:8765/v1"))
