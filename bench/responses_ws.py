"""OpenAI's Responses WebSocket mode against the HTTP Responses API, A/B in one run on one `chatd serve` (SmolLM2,
greedy), through the official `openai` SDK.

agent: a support agent's loop of tool calls (`tool_choice: required`, each call answered by the client), N rounds:
over one socket with `previous_response_id`; over HTTP with `previous_response_id`; over HTTP resending the whole
history (`store: false`: chatd matches it to its session). The three alternate round by round, each its own
conversation. Per call: the time to its first output event (a tool-only reply's items come once it is read: this is
the time to the call) and the time to its end; and the loop's end-to-end time.

lanes: sixteen customers at once, each a streamed reply of the same length: sixteen lanes on one socket against
sixteen HTTP clients, alternating (which goes first alternates too), after one uncounted batch each way; every
batch sixteen new conversations of its own; output tokens per second over the wall time of each batch.

    .venv/bin/python bench/responses_ws.py [--rounds 20] [--lanes 16] [--tokens 48] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

import openai
from common import write_result

from chatd.cli.server_process import ServerProcess

INSTRUCTIONS = "You are the support desk of a small internet provider. Look orders up before you answer."
TOOLS = [{"type": "function", "name": "lookup_order", "description": "Look an order up by its number",
          "parameters": {"type": "object", "properties": {"order": {"type": "string"}}, "required": ["order"]}}]
ENDS = ("response.completed", "response.incomplete", "response.failed", "error")


async def socket_round(connection, fields: dict) -> tuple[float, float, object]:
    """(ms to the first output event, ms to the end, the response) of one create on the socket."""
    started, first = time.perf_counter(), None
    await connection.response.create(**fields)
    async for event in connection:
        if first is None and event.type not in ("response.created", "response.in_progress"):
            first = time.perf_counter()
        if event.type in ENDS:
            assert event.type != "error" and event.type != "response.failed", event
            return 1000 * (first - started), 1000 * (time.perf_counter() - started), event.response
    raise RuntimeError("the socket closed")


async def http_round(client: openai.AsyncOpenAI, fields: dict) -> tuple[float, float, object]:
    """The same over HTTP, streamed."""
    started, first, final = time.perf_counter(), None, None
    async for event in await client.responses.create(stream=True, **fields):
        if first is None and event.type not in ("response.created", "response.in_progress"):
            first = time.perf_counter()
        if event.type in ENDS:
            final = event.response
    return 1000 * (first - started), 1000 * (time.perf_counter() - started), final


def outputs(response) -> list[dict]:
    return [{"type": "function_call_output", "call_id": item.call_id, "output": json.dumps(
        {"order": json.loads(item.arguments or "{}").get("order"), "status": "shipped yesterday"})}
        for item in response.output if item.type == "function_call"]


async def agent(client: openai.AsyncOpenAI, model: str, rounds: int, tokens: int) -> dict[str, dict]:
    """The three ways, alternating round by round: per-call times and each loop's total."""
    base = dict(model=model, instructions=INSTRUCTIONS, tools=TOOLS, tool_choice="required",
                max_output_tokens=tokens, temperature=0)
    first_input = {way: [{"role": "user", "content": f"Where are my orders {letter}-1001 to {letter}-1020? Look each "
                                                     "one up."}]  # (each way its own conversation: nothing shared)
                   for way, letter in (("socket", "A"), ("http_previous", "B"), ("http_whole", "C"))}
    times = {way: {"first_ms": [], "end_ms": [], "total_ms": 0.0} for way in ("socket", "http_previous", "http_whole")}
    # (one uncounted call first: the server's first call with these tools pays once for what every later one reuses)
    await http_round(client, {**base, "input": "Where is my order Z-1?", "store": False})
    async with client.responses.connect() as connection:
        previous = {"socket": None, "http_previous": None}
        whole: list = list(first_input["http_whole"])
        whole_last = None
        for index in range(rounds):
            for way in times:
                if way == "http_whole":
                    if whole_last is not None:
                        whole += [item.model_dump(exclude_none=True) for item in whole_last.output]
                        whole += outputs(whole_last)
                    fields = {**base, "input": whole, "store": False}
                else:
                    last = previous[way]
                    fields = {**base, "input": outputs(last) if last else first_input[way],
                              **({"previous_response_id": last.id} if last else {})}
                first, end, response = await (socket_round(connection, fields) if way == "socket"
                                              else http_round(client, fields))
                times[way]["first_ms"].append(first)
                times[way]["end_ms"].append(end)
                times[way]["total_ms"] += end
                if way == "http_whole":
                    whole_last = response
                else:
                    previous[way] = response
                assert outputs(response), f"round {index + 1} over {way} made no call"
    return times


async def lanes(client: openai.AsyncOpenAI, model: str, count: int, tokens: int, repeats: int) -> dict[str, list]:
    """Output tokens per second of `count` concurrent replies: lanes of one socket, and separate HTTP clients. Every
    batch is sixteen new conversations of its own (a batch that resent another's prompts would branch from their
    caches and skip their prefill), after one batch each way that is not counted; the way that goes first alternates."""
    fields = dict(model=model, instructions=INSTRUCTIONS, max_output_tokens=tokens, temperature=0)
    rates: dict[str, list] = {"socket": [], "http": []}

    def prompt(lane: int, batch: int) -> str:
        return f"Customer {lane} (ticket {batch}): my internet is slow in the evening."

    async with client.responses.connect() as connection:
        async def over_socket(batch: int) -> float:
            started = time.perf_counter()
            for lane in range(count):
                await connection.response.create(stream_id=f"c{lane}", input=prompt(lane, batch), **fields)
            produced, ended = 0, 0
            async for event in connection:
                if event.type in ENDS:
                    assert event.type in ("response.completed", "response.incomplete"), event
                    produced += event.response.usage.output_tokens
                    ended += 1
                    if ended == count:
                        break
            return produced / (time.perf_counter() - started)

        async def over_http(batch: int) -> float:
            started = time.perf_counter()
            finals = await asyncio.gather(*(http_round(client, {**fields, "input": prompt(lane, batch)})
                                            for lane in range(count)))
            return sum(final.usage.output_tokens for *_, final in finals) / (time.perf_counter() - started)

        ways = {"socket": over_socket, "http": over_http}
        batch = 0
        for repeat in range(-1, repeats):
            for way in (list(ways) if repeat % 2 else list(ways)[::-1]):
                batch += 1
                rate = await ways[way](batch)
                if repeat >= 0:
                    rates[way].append(rate)
    return rates


async def run(args: argparse.Namespace, url: str) -> dict:
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    result: dict = {"model": model}
    if args.part in ("agent", "both"):
        times = await agent(client, model, args.rounds, args.tokens)
        print(f"agent loop, {args.rounds} tool calls: {'way':<14} {'first ms p50':>12} {'end ms p50':>10} "
              f"{'rounds 2+ end ms mean':>21} {'total s':>8}")
        for way, row in times.items():
            print(f"{'':36}{way:<14} {statistics.median(row['first_ms']):>12.1f} "
                  f"{statistics.median(row['end_ms']):>10.1f} {statistics.mean(row['end_ms'][1:]):>21.1f} "
                  f"{row['total_ms'] / 1000:>8.2f}")
        result["agent"] = times
    if args.part in ("lanes", "both"):
        rates = await lanes(client, model, args.lanes, args.tokens, args.repeats)
        for way, values in rates.items():
            print(f"{args.lanes} at once over {way:<6}: {statistics.median(values):7.1f} output tokens/s (median of "
                  f"{len(values)}: {', '.join(f'{v:.1f}' for v in values)})")
        result["lanes"] = rates
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("agent", "lanes", "both"), default="both")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--lanes", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--flags", default="", help="more `chatd serve` flags")
    parser.add_argument("--output", type=Path, default=Path("bench/results/responses_ws.json"))
    args = parser.parse_args()
    server = ServerProcess(args.flags)
    try:
        result = asyncio.run(run(args, f"http://127.0.0.1:{server.port}/v1"))
    finally:
        server.stop()
    write_result(args.output, {**vars(args), "output": str(args.output), **result})


if __name__ == "__main__":
    main()
