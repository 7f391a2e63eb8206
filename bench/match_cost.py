"""What matching a stateless OpenAI request to its session costs, with many sessions cached.

A chatd server runs in this process with SmolLM2; its session store and prefix index are filled with
--sessions conversations of about --history-tokens tokens, all with the same system prompt (the hard
case: every session shares its first blocks). Then the time of the API's matching step (render the
request, look up the index, read and verify the candidates, pick a free session) is measured for a
request that continues one of them, and compared with the TTFT of such a turn. With --redis-url (an
empty database: it is flushed), sessions and the index are in Redis, as with several workers, and the
Redis memory the index takes per session is reported too.

    .venv/bin/python bench/match_cost.py [--sessions 100 10000] [--history-tokens 500] [--redis-url URL]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from common import REPLY, synthetic_history, write_result

from chatd.api.server import ChatServer
from chatd.config import Settings
from chatd.model.prompt import PromptRenderer
from sessions import Message

HERE = Path(__file__).parent


async def fill(server: ChatServer, scenario: dict, history: list[Message], count: int, renderer: PromptRenderer
               ) -> tuple[list[list[Message]], int]:
    """`count` sessions, each the shared history plus a distinct last exchange; their histories, and the bytes
    Redis took for indexing them (0 without Redis)."""
    histories, indexed = [], []
    for number in range(len(server.conversations.index.local), count):
        own = [*history, Message("user", f"My customer number is {number}."), Message("assistant", REPLY)]
        session = await server.sessions.create(scenario["system"], messages=own)
        indexed.append((session.session_id, renderer.render([Message("system", scenario["system"]), *own],
                                                            add_generation_prompt=False)))
        histories.append(own)
    before = await redis_memory(server)
    for session_id, token_ids in indexed:
        await server.conversations.index.add(None, session_id, token_ids)
    return histories, await redis_memory(server) - before


async def redis_memory(server: ChatServer) -> int:
    if not server.settings.redis_url:
        return 0
    return int((await server.sessions.client.info("memory"))["used_memory"])


async def measure(sessions: list[int], history_tokens: int, repeats: int, redis_url: str | None) -> list[dict]:
    scenario = json.loads((HERE / "scenarios" / "internet_support.json").read_text())
    rows, index_bytes = [], 0
    async with ChatServer(Settings(port=0, redis_url=redis_url)) as server:
        if redis_url:
            await server.sessions.client.flushdb()
        await server.wait_ready()
        renderer = PromptRenderer(server.engine.loaded.tokenizer)
        history = synthetic_history(scenario, renderer, history_tokens)
        histories: list[list[Message]] = []
        server.conversations.render(scenario["system"], history, "warm-up")  # the API's tokenizer copy, made once
        for count in sessions:
            added, grown = await fill(server, scenario, history, count, renderer)
            histories += added
            index_bytes += grown
            samples = []
            for repeat in range(repeats):
                own = histories[(repeat * 7919) % len(histories)]
                started = time.perf_counter()
                session, _, _ = await server.conversations.place(None, scenario["system"], own, "Any news?", None)
                samples.append(time.perf_counter() - started)
                assert session.messages == own, "the request must continue its own session"
            count = len(server.conversations.index.local)
            rows.append({"sessions": count, "match_ms": 1000 * statistics.median(samples),
                         "match_ms_max": 1000 * max(samples), "redis_index_bytes_per_session": index_bytes / count})
            print(f"{count:>6} sessions: matching {rows[-1]['match_ms']:.2f} ms (max {rows[-1]['match_ms_max']:.2f} ms)"
                  + (f"; the index takes {index_bytes / count:,.0f} bytes of Redis per session" if redis_url else ""),
                  flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[100, 10_000])
    parser.add_argument("--history-tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--redis-url", help="sessions and the index in this Redis database (flushed first)")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "match_cost.json")
    args = parser.parse_args()
    rows = asyncio.run(measure(sorted(args.sessions), args.history_tokens, args.repeats, args.redis_url))
    write_result(args.output, {"history_tokens": args.history_tokens, "redis": bool(args.redis_url), "rows": rows})


if __name__ == "__main__":
    main()
