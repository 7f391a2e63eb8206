"""A support bot written against the official `anthropic` SDK, served by chatd: point the SDK at chatd's port and
it works unchanged. The conversation is resent whole each turn, as with Anthropic's own API; chatd finds the session
that holds its cache, so each turn prefills only the new message (`usage.cache_read_input_tokens` says how much was
read from the cache). The policy is marked `cache_control`: it stays resident for an hour ahead of other caches.

    make run   # in another terminal: serves SmolLM2-135M on 127.0.0.1:8765
    .venv/bin/python examples/anthropic_bot.py
"""

from __future__ import annotations

import json
import sys

import anthropic

POLICY = ("You are the support assistant of Northwind Telecom. Orders ship within two days; refunds take five "
          "working days. Use the tools to look orders up. Answer in one or two short sentences.")
TOOLS = [{"name": "lookup_order", "description": "Find an order by its id (NW- and four digits).",
          "input_schema": {"type": "object", "properties": {"order_id": {"type": "string",
                                                                          "pattern": "^NW-[0-9]{4}$"}},
                           "required": ["order_id"], "additionalProperties": False}}]
ORDERS = {"NW-2231": {"status": "lost in transit", "refund": "possible"}}


def lookup_order(order_id: str) -> dict:
    return ORDERS.get(order_id, {"status": "unknown order"})


def main(base_url: str = "http://127.0.0.1:8765") -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused-without-keys")
    system = [{"type": "text", "text": POLICY, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    messages = []
    for question in ("Hi, my order NW-2231 never arrived.", "Can I get my money back?"):
        messages.append({"role": "user", "content": question})
        while True:
            reply = client.messages.create(model="smollm2-135m", max_tokens=96, system=system, messages=messages,
                                           tools=TOOLS, temperature=0)
            messages.append({"role": "assistant", "content": [block.model_dump() for block in reply.content]})
            calls = [block for block in reply.content if block.type == "tool_use"]
            if not calls:
                break
            messages.append({"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": call.id, "content": json.dumps(lookup_order(**call.input))}
                for call in calls]})
        text = "".join(block.text for block in reply.content if block.type == "text")
        usage = reply.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        print(f"> {question}\n{text}\n  (prompt {prompt} tokens, {usage.cache_read_input_tokens} read from the cache)")


if __name__ == "__main__":
    main(*sys.argv[1:])
