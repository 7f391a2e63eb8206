"""A four-turn support conversation with a tool round through litellm's `anthropic/` provider, pointed at chatd's
Messages API (only the base URL changed) and without `max_tokens` (litellm then sends its own large default).
Prints each turn as a JSON line."""

import json
import os
import sys

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # (its price list from the package, not the network)
import litellm  # noqa: E402

base_url, model_name = sys.argv[1:3]
TOOLS = [{"type": "function", "function": {
    "name": "lookup_order", "description": "Find an order by its id.",
    "parameters": {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]}}}]
messages = [{"role": "system", "content": "You are the support desk of a small internet provider. Answer briefly."}]
for turn, question in enumerate(["Where is my order NW-2231?", "When was it sent?", "Can you refund it?",
                                 "Thanks, goodbye."], start=1):
    messages.append({"role": "user", "content": question})
    calls = []
    while True:
        response = litellm.completion(model=f"anthropic/{model_name}", api_base=base_url, api_key="unused",
                                      messages=messages, tools=TOOLS, temperature=0, parallel_tool_calls=False,
                                      **({"tool_choice": "required"} if turn == 1 and not calls else
                                         {"tool_choice": "none", "stop": ["\n"]}))  # (short answers: the suite's time)
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            calls.append(call.function.name)
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": json.dumps({"order": "NW-2231", "status": "lost in transit"})})
    usage = response.usage  # (the turn's last request)
    print(json.dumps({"turn": turn, "text": message.content, "calls": calls, "input": usage.prompt_tokens,
                      "cache_read": usage.cache_read_input_tokens}), flush=True)
