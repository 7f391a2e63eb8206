"""Tool formats on a tiny random model whose chat template renders tools (Hermes `<tool_call>` JSON, as Qwen's
does): the template gets the tools, `required` and a named function hold the reply to calls the parser reads
back, a tool round prefills only its results; and the parsers read each format's calls (and refuse broken ones)."""

from __future__ import annotations

import copy
import dataclasses
import json

import jsonschema
import openai

from chatd.api.server import ChatServer
from chatd.api.tool_calling import (
    Function,
    HermesFormat,
    Llama3JsonFormat,
    ProseStream,
    ToolFormat,
    ToolSetup,
    format_for,
)
from chatd.config import Settings
from sessions import Message, ToolCall

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}\n"
    "{% endif %}"
    "# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>\nCall one with "
    "<tool_call>{\"name\": ..., \"arguments\": ...}</tool_call><|im_end|>\n{% endif %}"
    "{% for message in messages %}{% if message['role'] == 'system' %}{% if not tools %}<|im_start|>system\n"
    "{{ message['content'] }}<|im_end|>\n{% endif %}"
    "{% elif message['role'] == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message['content'] }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}{% if message.tool_calls %}"
    "{% for call in message.tool_calls %}\n<tool_call>\n{\"name\": \"{{ call.function.name }}\", \"arguments\": "
    "{{ call.function.arguments | tojson }}}\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
REFUND = {"type": "object", "properties": {"order": {"type": "integer", "minimum": 1, "maximum": 999},
                                           "full": {"type": "boolean"}}, "required": ["order", "full"],
          "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "refund", "parameters": REFUND}},
         {"type": "function", "function": {"name": "escalate", "parameters": {"type": "object", "properties": {}}}}]


def _hermes_model(tiny):
    tokenizer = copy.deepcopy(tiny.tokenizer)
    tokenizer.chat_template = HERMES_TEMPLATE
    return dataclasses.replace(tiny, tokenizer=tokenizer)


async def test_a_template_that_renders_tools_gets_them_and_its_calls_are_read_back(tiny):
    hermes = _hermes_model(tiny)
    assert isinstance(format_for(hermes.tokenizer.chat_template), HermesFormat)
    async with ChatServer(Settings(port=0, model="tiny"), load=lambda: hermes) as server:
        await server.wait_ready()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x", max_retries=0)
        await client.__aenter__()  # closed below, on this loop
        messages = [{"role": "system", "content": "Support desk."}, {"role": "user", "content": "Refund order 7."}]
        first = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                     tool_choice={"type": "function", "function": {"name": "refund"}},
                                                     max_tokens=60, temperature=0)
        calls = first.choices[0].message.tool_calls
        assert first.choices[0].finish_reason == "tool_calls" and [c.function.name for c in calls] == ["refund"]
        jsonschema.validate(json.loads(calls[0].function.arguments), REFUND)
        assert first.usage.prompt_tokens > 60, "the template rendered the tools into the prompt"
        messages += [first.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": calls[0].id, "content": '{"refunded": true}'}]
        second = await client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS,
                                                      tool_choice="required", max_tokens=60, temperature=0)
        assert second.choices[0].message.tool_calls
        assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens + \
            first.usage.completion_tokens - 1, "only the tool's result and the template's tokens were prefilled"
        await client.close()


def test_each_format_parses_its_own_calls_and_leaves_broken_ones_as_text():
    hermes, llama, generic = HermesFormat(), Llama3JsonFormat(), ToolFormat()
    text, calls = hermes.parse('Checking.\n<tool_call>\n{"name": "refund", "arguments": {"order": 7, "full": true}}'
                               '\n</tool_call>\n<tool_call>\n{"name": "escalate", "arguments": {}}\n</tool_call>')
    assert text == "Checking." and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("refund", {"order": 7, "full": True}), ("escalate", {})]
    assert len({c.id for c in calls}) == 2
    broken = '<tool_call>\n{"name": "refund", "arguments": {"order": 7\n</tool_call>'
    assert hermes.parse(broken) == (broken, [])
    text, calls = llama.parse('<|python_tag|>{"name": "refund", "parameters": {"order": 3, "full": false}}')
    assert text == "" and calls[0].name == "refund" and json.loads(calls[0].arguments) == {"order": 3, "full": False}
    assert llama.parse("Your refund is on its way.") == ("Your refund is on its way.", [])
    setup = ToolSetup(generic, (Function("refund", "Refund an order.", REFUND),))
    rendered = setup.engine_messages([
        Message("system", "Support desk."), Message("user", "Refund 7."),
        Message("assistant", "", tool_calls=(ToolCall("call_1", "refund", '{"order": 7, "full": true}'),)),
        Message("tool", '{"refunded": true}', tool_call_id="call_1")])
    assert '"name": "refund"' in rendered[0].content and rendered[0].content.startswith("Support desk.")
    assert rendered[2].content == \
        '<tool_call>\n{"name": "refund", "arguments": {"order": 7, "full": true}}\n</tool_call>'
    assert rendered[3] == Message("user", '<tool_response>\n{"refunded": true}\n</tool_response>')
    assert setup.grammar().trigger == "<tool_call>", "auto: free text until the model opens a call"
    assert ToolSetup(generic, setup.functions, choice="required").grammar().trigger is None


def test_streamed_prose_is_always_the_start_of_the_replys_prose():
    reply = 'Let me check.\n\n<tool_call>\n{"name": "escalate", "arguments": {}}\n</tool_call>'
    prose, calls = HermesFormat().parse(reply)
    for pieces in (list(reply), [reply[:14], reply[14:20], reply[20:]]):
        stream = ProseStream("<tool_call>")
        sent = "".join(stream.push(piece) for piece in pieces)
        assert sent == "Let me check." and sent + stream.rest(prose, bool(calls)) == prose
    plain = "No call here, only text that looks like <tool or ends with spaces  "
    stream = ProseStream("<tool_call>")
    sent = "".join(stream.push(piece) for piece in plain)
    assert sent + stream.rest(plain, False) == plain
