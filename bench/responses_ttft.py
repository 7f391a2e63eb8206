"""TTFT and request bytes of an 8-turn conversation through the Responses API (`previous_response_id`:
only the new input is sent) against chat completions (the whole history resent and matched) and against
the Responses API on a server without a session cache.

Each configuration runs in this process on its own server with SmolLM2, one after the other; each plays
the bench scenarios' conversations (their turns repeated to --turns), streamed, greedy, --max-new-tokens
per reply. TTFT is measured at the client, from sending the request to the first text delta; request
bytes are the JSON body sent.

    .venv/bin/python bench/responses_ttft.py [--turns 8] [--max-new-tokens 32] [--conversations 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import httpx
from common import write_result

from chatd.api.server import ChatServer
from chatd.config import Settings
from chatd.model.loader import load_model

HERE = Path(__file__).parent


async def responses_turn(http: httpx.AsyncClient, model: str, text: str, previous: str | None, system: str,
                         max_new_tokens: int) -> tuple[float, int, str, str]:
    """One streamed response: TTFT (s), request bytes, the reply, the response id."""
    body = {"model": model, "input": text, "max_output_tokens": max_new_tokens, "temperature": 0, "stream": True}
    body.update({"previous_response_id": previous} if previous else {"instructions": system})
    payload = json.dumps(body).encode()
    sent, first, reply, response_id = time.perf_counter(), None, [], None
    async with http.stream("POST", "/v1/responses", content=payload,
                           headers={"Content-Type": "application/json"}) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            event = json.loads(line[6:])
            if event["type"] == "response.output_text.delta":
                first = first or time.perf_counter()
                reply.append(event["delta"])
            elif event["type"] == "response.created":
                response_id = event["response"]["id"]
    return first - sent, len(payload), "".join(reply), response_id


async def completions_turn(http: httpx.AsyncClient, model: str, messages: list[dict], max_new_tokens: int
                           ) -> tuple[float, int, str]:
    """One streamed chat completion with the whole history: TTFT (s), request bytes, the reply."""
    payload = json.dumps({"model": model, "messages": messages, "max_tokens": max_new_tokens, "temperature": 0,
                          "stream": True}).encode()
    sent, first, reply = time.perf_counter(), None, []
    async with http.stream("POST", "/v1/chat/completions", content=payload,
                           headers={"Content-Type": "application/json"}) as response:
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk["choices"] and (delta := chunk["choices"][0]["delta"].get("content")):
                first = first or time.perf_counter()
                reply.append(delta)
    return first - sent, len(payload), "".join(reply)


async def play(server: ChatServer, api: str, scenarios: list[dict], turns: int, max_new_tokens: int
               ) -> dict[int, list[tuple[float, int]]]:
    """Every scenario's conversation through `api`; per turn, (TTFT, request bytes) of each."""
    model = server.settings.model
    by_turn: dict[int, list[tuple[float, int]]] = {turn: [] for turn in range(1, turns + 1)}
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=600) as http:
        for scenario in scenarios:
            previous, messages = None, [{"role": "system", "content": scenario["system"]}]
            for turn in range(1, turns + 1):
                text = scenario["turns"][(turn - 1) % len(scenario["turns"])]
                if api == "responses":
                    ttft, sent, _, previous = await responses_turn(http, model, text, previous, scenario["system"],
                                                                   max_new_tokens)
                else:
                    messages.append({"role": "user", "content": text})
                    ttft, sent, reply = await completions_turn(http, model, messages, max_new_tokens)
                    messages.append({"role": "assistant", "content": reply})
                by_turn[turn].append((ttft, sent))
    return by_turn


async def measure(args) -> list[dict]:
    loaded = load_model(args.model, device="cpu")
    scenarios = [json.loads(path.read_text()) for path in sorted((HERE / "scenarios").glob("*.json"))]
    scenarios = scenarios[:args.conversations]
    rows = []
    for label, api, session_cache in [("responses, previous_response_id", "responses", True),
                                      ("chat completions, history resent", "completions", True),
                                      ("responses, --no-session-cache", "responses", False)]:
        async with ChatServer(Settings(port=0, model=args.model, session_cache=session_cache),
                              load=lambda: loaded) as server:
            await server.wait_ready()
            by_turn = await play(server, api, scenarios, args.turns, args.max_new_tokens)
        late = [sample for turn in range(5, args.turns + 1) for sample in by_turn[turn]]
        rows.append({"config": label, "ttft_ms_turns_5_plus": 1000 * statistics.median(t for t, _ in late),
                     "request_bytes_by_turn": {turn: statistics.mean(b for _, b in samples)
                                               for turn, samples in by_turn.items()}})
        row = rows[-1]
        print(f"{label:<36} TTFT p50, turns 5+: {row['ttft_ms_turns_5_plus']:7.1f} ms; request bytes, turn 1 / "
              f"{args.turns}: {row['request_bytes_by_turn'][1]:,.0f} / {row['request_bytes_by_turn'][args.turns]:,.0f}",
              flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--conversations", type=int, default=3)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "responses_ttft.json")
    args = parser.parse_args()
    rows = asyncio.run(measure(args))
    write_result(args.output, {"turns": args.turns, "max_new_tokens": args.max_new_tokens, "rows": rows})


if __name__ == "__main__":
    main()
