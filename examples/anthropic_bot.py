"""A support bot on the official `anthropic` SDK's tool runner, served by chatd: point the SDK at chatd's port and it
works unchanged. The runner threads its requests (Anthropic's message threads, its default): after the first, each
request sends only what is new (the tools' results), and chatd runs it as the next turn of the thread's session, so
only that is prefilled (`usage.cache_read_input_tokens` says how much of the prompt was read from the cache).

    make run   # in another terminal: serves SmolLM2-135M on 127.0.0.1:8765
    .venv/bin/python examples/anthropic_bot.py
"""

from __future__ import annotations

import json
import sys

import anthropic
from anthropic import beta_tool

POLICY = ("You are the support assistant of Northwind Telecom. Orders ship within two days; refunds take five "
          "working days. Use the tools to look orders up. Answer in one or two short sentences.")
ORDERS = {"NW-2231": {"status": "lost in transit", "refund": "possible"}}


@beta_tool
def lookup_order(order_id: str) -> str:
    """Find an order by its id.

    Args:
        order_id: the order's id: NW- and four digits, such as NW-2231
    """
    return json.dumps(ORDERS.get(order_id, {"status": "unknown order"}))


def main(base_url: str = "http://127.0.0.1:8765") -> None:
    client = anthropic.Anthropic(base_url=base_url, api_key="unused-without-keys")
    runner = client.beta.messages.tool_runner(
        model="smollm2-135m", max_tokens=96, system=POLICY, tools=[lookup_order], max_iterations=4,
        messages=[{"role": "user", "content": "Hi, my order NW-2231 never arrived. Can I get my money back?"}],
        extra_body={"temperature": 0})
    for reply in runner:  # each reply; the runner calls the tools and sends their results back
        text = "".join(block.text for block in reply.content if block.type == "text")
        calls = [f"{block.name}({json.dumps(block.input)})" for block in reply.content if block.type == "tool_use"]
        usage = reply.usage
        prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
        print(f"{text or ''}{' calls ' + ', '.join(calls) if calls else ''}\n"
              f"  (prompt {prompt} tokens, {usage.cache_read_input_tokens} read from the cache)")


if __name__ == "__main__":
    main(*sys.argv[1:])
