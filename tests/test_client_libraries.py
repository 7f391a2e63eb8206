"""The client libraries support bots are built with, each run as its users run it against `chatd serve` with SmolLM2
(only the base URL changed): Vercel's AI SDK (`openai(model)`, the Responses API with `store` on, whose later turns
refer to earlier replies by item id; `anthropic(model)` without maxOutputTokens), pydantic-ai (a turn restricted to
some tools: `allowed_tools`) and litellm's `anthropic/` without `max_tokens`, from environments of their own
(`make test` installs them); openai-agents' `OpenAIConversationsSession`. Each is a four-turn support conversation
with a tool round, every later turn reading its history from the cache."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import shutil
from pathlib import Path

import openai
import pytest

from chatd.api.server import ChatServer
from chatd.config import Settings

ROOT = Path(__file__).resolve().parent.parent
CLIENTS = Path(__file__).resolve().parent / "clients"
CLIENTS_PYTHON = ROOT / ".venv" / "clients" / "bin" / "python"
MODEL = "smollm2-135m"
needs_node = pytest.mark.skipif(shutil.which("node") is None or not (CLIENTS / "node_modules" / "ai").is_dir(),
                                reason="Node.js or the AI SDK (npm ci --prefix tests/clients) is not installed")
needs_clients = pytest.mark.skipif(not CLIENTS_PYTHON.exists(),
                                   reason="the client-library venv (.venv/clients) is not installed")


@pytest.fixture
async def desk(smollm2):
    async with ChatServer(Settings(port=0), load=lambda: smollm2) as server:
        await server.wait_ready()
        yield server


async def run_client(*command: str) -> list[dict]:
    """The client's turns, one JSON line each; its error output if it fails."""
    process = await asyncio.create_subprocess_exec(*command, stdout=asyncio.subprocess.PIPE,
                                                   stderr=asyncio.subprocess.PIPE, cwd=CLIENTS)
    out, err = await asyncio.wait_for(process.communicate(), 240)
    assert process.returncode == 0, err.decode()[-3000:]
    turns = [json.loads(line) for line in out.decode().splitlines() if line.startswith("{")]
    assert [turn["turn"] for turn in turns] == [1, 2, 3, 4], out.decode()[-2000:]
    return turns


def assert_later_turns_read_the_cache(turns: list[dict], input_key: str, cached_key: str) -> None:
    for turn in turns[1:]:
        assert turn[cached_key] >= 0.8 * turn[input_key], turn


@needs_node
async def test_the_ai_sdk_openai_provider_refers_to_earlier_replies_by_id(desk):
    turns = await run_client("node", "ai_sdk_support_desk.mjs", "openai", f"http://127.0.0.1:{desk.port}/v1", MODEL)
    assert turns[0]["calls"] == ["lookup_order"]
    usage = [{"input": turn["usage"]["inputTokens"], "cached": turn["usage"]["cachedInputTokens"]} for turn in turns]
    assert_later_turns_read_the_cache(usage, "input", "cached")


@needs_node
async def test_the_ai_sdk_anthropic_provider_without_max_output_tokens(desk):
    turns = await run_client("node", "ai_sdk_support_desk.mjs", "anthropic", f"http://127.0.0.1:{desk.port}/v1",
                             MODEL)
    assert turns[0]["calls"] and set(turns[0]["calls"]) == {"lookup_order"}
    usage = [{"input": turn["usage"]["inputTokens"], "cached": turn["usage"]["cachedInputTokens"]} for turn in turns]
    assert_later_turns_read_the_cache(usage, "input", "cached")


@needs_clients
async def test_pydantic_ai_restricts_a_turn_to_some_tools(desk):
    turns = await run_client(str(CLIENTS_PYTHON), "pydantic_ai_support_desk.py", f"http://127.0.0.1:{desk.port}/v1",
                             MODEL)
    assert turns[0]["calls"] and set(turns[0]["calls"]) <= {"lookup_order", "final_result"}, turns[0]
    assert "open_ticket" not in turns[0]["calls"]
    assert_later_turns_read_the_cache(turns, "input", "cache_read")


@needs_clients
async def test_litellm_anthropic_without_max_tokens(desk):
    turns = await run_client(str(CLIENTS_PYTHON), "litellm_support_desk.py", f"http://127.0.0.1:{desk.port}", MODEL)
    assert turns[0]["calls"] == ["lookup_order"]
    assert_later_turns_read_the_cache(turns, "input", "cache_read")


@pytest.mark.skipif(importlib.util.find_spec("agents") is None, reason="openai-agents is not installed")
async def test_openai_agents_conversations_session_keeps_the_history_on_the_server(desk):
    """openai-agents' `OpenAIConversationsSession`: the run's items are added to a chatd conversation
    (`conversations.items.create`) and read back newest first; every later turn reads its history from the cache."""
    from agents import Agent, OpenAIConversationsSession, OpenAIResponsesModel, Runner, function_tool
    from agents import ModelSettings as AgentSettings

    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{desk.port}/v1", api_key="unused", max_retries=0)

    @function_tool
    def lookup_order(order: str) -> str:
        """Find an order by its id."""
        return json.dumps({"order": order, "status": "lost in transit"})

    agent = Agent(name="desk", instructions="You are the support desk of a small internet provider. Answer briefly.",
                  model=OpenAIResponsesModel(MODEL, client), tools=[lookup_order],
                  model_settings=AgentSettings(temperature=0, max_tokens=48, tool_choice="required"),
                  reset_tool_choice=True)
    session = OpenAIConversationsSession(openai_client=client)
    cached = []
    for turn, question in enumerate(("Where is my order NW-2231?", "When was it sent?", "Can you refund it?",
                                      "Thanks, goodbye.")):
        answering = agent if turn == 0 else agent.clone(  # (later turns answer in words: one request each)
            model_settings=AgentSettings(temperature=0, max_tokens=48, tool_choice="none"))
        result = await Runner.run(answering, question, session=session, max_turns=3)
        usage = result.context_wrapper.usage
        cached.append({"input": usage.request_usage_entries[-1].input_tokens,
                       "cached": usage.request_usage_entries[-1].input_tokens_details.cached_tokens})
    items = await session.get_items()
    assert sum(item.get("type") == "function_call" for item in items) >= 1
    assert [item.get("role") for item in items if item.get("role") == "user"] == ["user"] * 4
    assert_later_turns_read_the_cache(cached, "input", "cached")
