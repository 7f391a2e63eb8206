"""What matching a stateless OpenAI request to its session costs, with many sessions cached.

A chatd server runs in this process with SmolLM2; its session store and prefix index are filled with
--sessions conversations of about --history-tokens tokens, all with the same system prompt (the hard
case: every session shares its first blocks). Then the time of the API's matching step (render the
request, look up the index, read and verify the candidates, claim the session) is measured for a
request that continues one of them, and compared with the TTFT of such a turn.

    .venv/bin/python bench/match_cost.py [--sessions 100 10000] [--history-tokens 500]
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
               ) -> list[list[Message]]:
    """`count` sessions, each the shared history plus a distinct last exchange; their histories."""
    histories = []
    for number in range(len(server.openai.index), count):
        own = [*history, Message("user", f"My customer number is {number}."), Message("assistant", REPLY)]
        session = await server.sessions.create(scenario["system"], messages=own)
        session.token_ids = renderer.render([Message("system", scenario["system"]), *own], add_generation_prompt=False)
        server.openai.index.add(None, session.session_id, session.token_ids)
        histories.append(own)
    return histories


async def measure(sessions: list[int], history_tokens: int, repeats: int) -> list[dict]:
    scenario = json.loads((HERE / "scenarios" / "internet_support.json").read_text())
    rows = []
    async with ChatServer(Settings(port=0)) as server:
        await server.wait_ready()
        renderer = PromptRenderer(server.engine.loaded.tokenizer)
        history = synthetic_history(scenario, renderer, history_tokens)
        histories: list[list[Message]] = []
        server.openai._render(scenario["system"], history, "warm-up")  # the API's tokenizer copy, made once
        for count in sessions:
            histories += await fill(server, scenario, history, count, renderer)
            samples = []
            for repeat in range(repeats):
                own = histories[(repeat * 7919) % len(histories)]
                started = time.perf_counter()
                session = await server.openai._place(None, scenario["system"], own, "Any news?", None)
                samples.append(time.perf_counter() - started)
                server.turns.release_claim(session.session_id)
                assert session.messages == own, "the request must continue its own session"
            rows.append({"sessions": len(server.openai.index), "match_ms": 1000 * statistics.median(samples),
                         "match_ms_max": 1000 * max(samples)})
            print(f"{rows[-1]['sessions']:>6} sessions: matching {rows[-1]['match_ms']:.2f} ms "
                  f"(max {rows[-1]['match_ms_max']:.2f} ms)", flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, nargs="+", default=[100, 10_000])
    parser.add_argument("--history-tokens", type=int, default=500)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "match_cost.json")
    args = parser.parse_args()
    rows = asyncio.run(measure(sorted(args.sessions), args.history_tokens, args.repeats))
    write_result(args.output, {"history_tokens": args.history_tokens, "rows": rows})


if __name__ == "__main__":
    main()
