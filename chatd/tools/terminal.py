"""`chatd chat`: talk to a running server from a terminal."""

from __future__ import annotations

import asyncio
import sys

from chatd.tools.client import ChatClient, ChatError


async def chat(url: str, system: str | None, session_id: str | None, max_new_tokens: int,
               api_key: str | None = None) -> None:
    """An interactive conversation in the terminal."""
    async with await ChatClient.connect(url, api_key=api_key) as client:
        ready = await client.open_session(system=system, session_id=session_id)
        print(f"session {ready.session_id} ({ready.turns} turns so far). Ctrl-D to quit.", file=sys.stderr)
        while True:
            try:
                line = await asyncio.to_thread(input, "you> ")
            except EOFError:
                return
            if not line.strip():
                continue
            turn = await client.chat(ready.session_id, line, max_new_tokens=max_new_tokens)
            print("bot> ", end="", flush=True)
            async for text in turn:
                print(text, end="", flush=True)
            print()
            try:
                done = await turn.result()
            except ChatError as error:
                print(f"[error {error.code}: {error.message}]", file=sys.stderr)
                continue
            reason = f" ({done.cache.miss_reason})" if done.cache.miss_reason else ""
            print(f"[{done.cache.source}{reason}, cached {done.usage.cached_tokens}/{done.usage.prompt_tokens} "
                  f"prompt tokens, TTFT {done.timings.ttft_ms:.0f} ms, {done.timings.tokens_per_s:.1f} tok/s]",
                  file=sys.stderr)
