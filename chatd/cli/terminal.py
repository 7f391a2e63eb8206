"""`chatd chat`: talk to a running server from a terminal (and, with tools, play the functions yourself)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

from chatd.api.websocket.protocol import ChatDone
from chatd.cli.client import ChatClient, ChatError, TurnStream


def tool_fields_from(tools: Path | None, json_schema: Path | None, tool_choice: str | None = None) -> dict:
    """`--tools`, `--json-schema` and `--tool-choice` as a session's tool fields; ValueError naming a file that
    is not JSON."""
    fields: dict = {}
    if tool_choice is not None:
        fields["tool_choice"] = tool_choice if tool_choice in ("none", "auto", "required") else {"name": tool_choice}
    for path, build in ((tools, lambda value: {"tools": value}),
                        (json_schema, lambda value: {"response_format": {"type": "json_schema", "schema": value}})):
        if path is not None:
            try:
                fields |= build(json.loads(path.read_text()))
            except (OSError, ValueError) as error:
                raise ValueError(f"{path}: {error}") from None
    return fields


async def chat(url: str, system: str | None, session_id: str | None, max_new_tokens: int,
               api_key: str | None = None, tool_fields: dict | None = None) -> None:
    """An interactive conversation in the terminal; each call the model makes asks you for its result."""
    async with await ChatClient.connect(url, api_key=api_key) as client:
        ready = await client.open_session(system=system, session_id=session_id, **(tool_fields or {}))
        print(f"session {ready.session_id} ({ready.turns} turns so far). Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                return
            if not line.strip():
                continue
            done = await _show(await client.chat(ready.session_id, line, max_new_tokens=max_new_tokens))
            while done is not None and done.tool_calls:
                results = {}
                for call in done.tool_calls:
                    try:
                        results[call.id] = await asyncio.to_thread(input, f"result of {call.name}({call.arguments})> ")
                    except EOFError:
                        return
                done = await _show(await client.send_tool_results(ready.session_id, results,
                                                                  max_new_tokens=max_new_tokens))


async def _show(turn: TurnStream) -> ChatDone | None:
    """Print a reply as it streams, its calls and its summary; None when it failed."""
    print("bot> ", end="", flush=True)
    async for text in turn:
        print(text, end="", flush=True)
    print()
    try:
        done = await turn.result()
    except ChatError as error:
        print(f"[error {error.code}: {error.message}]", file=sys.stderr)
        return None
    for call in done.tool_calls:
        print(f"call> {call.name}({call.arguments})")
    reason = f" ({done.cache.miss_reason})" if done.cache.miss_reason else ""
    print(f"[{done.cache.source}{reason}, cached {done.usage.cached_tokens}/{done.usage.prompt_tokens} "
          f"prompt tokens, TTFT {done.timings.ttft_ms:.0f} ms, {done.timings.tokens_per_s:.1f} tok/s]",
          file=sys.stderr)
    return done
