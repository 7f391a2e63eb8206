"""A four-turn support conversation with a tool round through pydantic-ai, pointed at chatd's chat completions (only
the base URL changed); the first turn offers only some of the agent's tools (`ToolOrOutput`, which pydantic-ai sends
as OpenAI's `allowed_tools`). Prints each turn as a JSON line."""

import json
import sys

from pydantic import BaseModel
from pydantic_ai import Agent
from pydantic_ai.models.openai import OpenAIChatModel
from pydantic_ai.providers.openai import OpenAIProvider
from pydantic_ai.settings import ModelSettings, ToolOrOutput


class Answer(BaseModel):
    """The reply to the customer."""

    text: str


base_url, model_name = sys.argv[1:3]
model = OpenAIChatModel(model_name, provider=OpenAIProvider(base_url=base_url, api_key="unused"))
agent = Agent(model, system_prompt="You are the support desk of a small internet provider. Answer briefly.",
              output_type=[str, Answer])


@agent.tool_plain
def lookup_order(order: str) -> dict:
    """Find an order by its id."""
    return {"order": order, "status": "lost in transit"}


@agent.tool_plain
def open_ticket(summary: str) -> dict:
    """Open a support ticket."""
    return {"ticket": "T-88"}


history = []
for turn, question in enumerate(["Where is my order NW-2231?", "When was it sent?", "Can you refund it?",
                                 "Thanks, goodbye."], start=1):
    settings = ModelSettings(temperature=0, max_tokens=48, stop_sequences=["\n"] if turn > 1 else [],
                             tool_choice=["lookup_order", "final_result"] if turn == 1 else
                             ToolOrOutput(function_tools=["open_ticket"]) if turn == 3 else "auto")
    result = agent.run_sync(question, message_history=history, model_settings=settings)
    history = result.all_messages()
    calls = [part.tool_name for message in result.new_messages() for part in message.parts
             if part.part_kind == "tool-call"]
    usage = result.usage()
    print(json.dumps({"turn": turn, "text": str(result.output), "calls": calls, "input": usage.input_tokens,
                      "cache_read": usage.cache_read_tokens}), flush=True)
