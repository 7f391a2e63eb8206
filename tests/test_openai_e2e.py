"""The OpenAI-compatible API with the real SmolLM2 and the official `openai` client: a stateless
8-turn conversation lands on its cached session and answers exactly like the websocket path."""

from __future__ import annotations

import importlib.util

import openai
import pytest
from websockets.asyncio.client import connect

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from tests.test_e2e_smollm2 import SYSTEM
from tests.test_e2e_smollm2 import TURNS as WEBSOCKET_TURNS

MODEL = "smollm2-135m"
TURNS = [*WEBSOCKET_TURNS, "How long would a technician take to come?", "Can I pay my bill online?",
         "Great, that is all. Goodbye!"]


async def test_stateless_conversation_equals_the_websocket_path_and_reuses_its_cache(smollm2):
    async with ChatServer(Settings(port=0), load=lambda: smollm2) as server:
        await server.wait_ready()
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused", max_retries=0)
        assert [model.id for model in (await client.models.list()).data] == [MODEL]
        messages = [{"role": "system", "content": SYSTEM}]
        async with ChatClient(await connect(server.url)) as websocket:
            session_id = (await websocket.open_session(system=SYSTEM)).session_id
            for index, content in enumerate(TURNS):
                messages.append({"role": "user", "content": content})
                stream = await client.chat.completions.create(
                    model=MODEL, messages=messages, max_tokens=24, temperature=0, stream=True,
                    stream_options={"include_usage": True})
                pieces, usage, finish = [], None, None
                async for chunk in stream:
                    if chunk.choices:
                        pieces.append(chunk.choices[0].delta.content or "")
                        finish = chunk.choices[0].finish_reason or finish
                    else:
                        usage = chunk.usage
                reply = "".join(pieces)
                messages.append({"role": "assistant", "content": reply})
                done = await (await websocket.chat(session_id, content, max_new_tokens=24)).result()
                assert reply == done.content, f"turn {index + 1}"
                assert usage.completion_tokens == done.usage.completion_tokens
                assert usage.prompt_tokens == done.usage.prompt_tokens
                assert finish in ("stop", "length")
                if index >= 2:
                    assert usage.prompt_tokens_details.cached_tokens >= 0.8 * usage.prompt_tokens, (index, usage)
        plain = await client.chat.completions.create(model=MODEL, messages=messages + [
            {"role": "user", "content": "One more question: is there a fee?"}], max_tokens=16, temperature=0)
        assert plain.choices[0].message.content and plain.usage.prompt_tokens_details.cached_tokens > 0.8 * \
            plain.usage.prompt_tokens


@pytest.mark.skipif(importlib.util.find_spec("langchain_openai") is None, reason="langchain-openai not installed")
async def test_langchain_chat_openai_runs_a_tool_round_reading_each_later_turn_from_the_cache(smollm2):
    """langchain-openai's `ChatOpenAI` with a tool bound, as a support bot uses it: four turns (a question, a forced
    call of the tool, its result, a last question), each later one reading at least 0.8 of its input from the cache
    (langchain's `usage_metadata.input_token_details.cache_read`), the call's arguments parsed into `tool_calls`."""
    from langchain_core.messages import HumanMessage, SystemMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def lookup_line(customer: str) -> str:
        """Look up the status of a customer's internet line."""
        return f"The line of {customer} is down since 9:00; a technician is booked."

    async with ChatServer(Settings(port=0), load=lambda: smollm2) as server:
        await server.wait_ready()
        chat = ChatOpenAI(model=MODEL, base_url=f"http://127.0.0.1:{server.port}/v1", api_key="unused",
                          temperature=0, max_tokens=48, stream_usage=True, max_retries=0)
        bot, forced = chat.bind_tools([lookup_line]), chat.bind_tools([lookup_line], tool_choice="lookup_line")
        history = [SystemMessage(SYSTEM), HumanMessage(TURNS[0])]
        history.append(await bot.ainvoke(history))
        history.append(HumanMessage("Please check the line of customer Ada Lovelace."))
        called = await forced.ainvoke(history)
        assert called.tool_calls and called.tool_calls[0]["name"] == "lookup_line", called
        history += [called, ToolMessage(lookup_line.invoke(called.tool_calls[0]["args"]),
                                        tool_call_id=called.tool_calls[0]["id"])]
        answered = await bot.ainvoke(history)
        history += [answered, HumanMessage(TURNS[1])]
        last = await bot.ainvoke(history)
        for reply in (called, answered, last):
            usage = reply.usage_metadata
            assert usage["input_token_details"]["cache_read"] >= 0.8 * usage["input_tokens"], usage
        assert answered.content and last.content


async def test_vllm_sampling_extensions_fix_reply_lengths_as_benchmark_clients_expect(openai_pair, smollm2):
    """GuideLLM and `vllm bench` send `ignore_eos` (with `stop: null`) to fix each reply's length: honoured, not
    ignored; `min_tokens` holds every ending token back until then; `stop_token_ids` end a reply at a token; an id
    the model does not have is a 400 naming it."""
    client, _ = openai_pair
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Hi!"}]
    plain = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 40, "it ends on its own"
    fixed = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, temperature=0,
                                                 stop=None, extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 40 and fixed.choices[0].finish_reason == "length"
    assert fixed.choices[0].message.content.startswith(plain.choices[0].message.content.rstrip()[:10])
    floor = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                 extra_body={"min_tokens": plain.usage.completion_tokens + 5})
    assert floor.usage.completion_tokens >= plain.usage.completion_tokens + 5
    words = plain.choices[0].message.content.split()
    stop_id = smollm2.tokenizer.encode(" " + words[2], add_special_tokens=False)[0]
    stopped = await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=60, temperature=0,
                                                   extra_body={"stop_token_ids": [stop_id]})
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < plain.usage.completion_tokens
    assert plain.choices[0].message.content.startswith(stopped.choices[0].message.content)
    for bad, param in (({"stop_token_ids": [10**9]}, "stop_token_ids[0]"), ({"min_tokens": 50}, "min_tokens")):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.chat.completions.create(model=MODEL, messages=messages, max_tokens=40, extra_body=bad)
        assert refused.value.body["param"] == param


async def test_text_completions_answer_as_transformers_and_a_growing_prompt_reads_its_prefix(openai_pair, smollm2):
    """`POST /v1/completions` (what `vllm bench serve` sends): the reply is what transformers' greedy `generate`
    gives for the prompt's text; a client that sends its prompt again, grown, reads the shared prefix from the cache
    and answers as a cacheless server; streamed, the text and the usage arrive; what chatd cannot do is refused."""
    client, uncached = openai_pair
    prompt = "The support desk of a small internet provider answers: to restart your router,"
    completion = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
    ids = smollm2.tokenizer(prompt, return_tensors="pt")
    expected = smollm2.model.generate(**ids, max_new_tokens=16, do_sample=False)[0, ids["input_ids"].shape[1]:]
    assert completion.choices[0].text == smollm2.tokenizer.decode(expected, skip_special_tokens=True)
    assert completion.object == "text_completion" and completion.usage.completion_tokens == len(expected)
    grown = prompt + completion.choices[0].text + " Then wait two minutes and"
    again, reference = [await each.completions.create(model=MODEL, prompt=grown, max_tokens=16, temperature=0)
                        for each in (client, uncached)]
    assert again.choices[0].text == reference.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens >= completion.usage.total_tokens - 2, again.usage
    pieces, usage = [], None
    async for chunk in await client.completions.create(model=MODEL, prompt=grown, max_tokens=16, temperature=0,
                                                       stream=True, stream_options={"include_usage": True}):
        if chunk.choices:
            pieces.append(chunk.choices[0].text)
        else:
            usage = chunk.usage
    assert "".join(pieces) == again.choices[0].text and usage.completion_tokens == again.usage.completion_tokens
    fixed = await client.completions.create(model=MODEL, prompt=prompt, max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
    assert fixed.usage.completion_tokens == 24 and fixed.choices[0].finish_reason == "length"
    for bad, param in (({"n": 2}, "n"), ({"echo": True}, "echo"), ({"prompt": ["a", "b"]}, "prompt")):
        with pytest.raises(openai.BadRequestError) as refused:
            await client.completions.create(**{"model": MODEL, "prompt": prompt, "max_tokens": 4, **bad})
        assert refused.value.body["param"] == param
