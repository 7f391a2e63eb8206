"""What idle connections cost a `chatd serve` process: its resident memory per open connection (with
keepalive pings), and the chatting customers' TTFT with and without them. Loopback only.

    .venv/bin/python bench/idle_connections.py [--idle 500] [--customers 16] [--turns 3]
"""

from __future__ import annotations

import argparse
import asyncio
import re
from pathlib import Path

from common import write_result
from websockets.asyncio.client import connect

from chatd.cli.client import ChatClient
from chatd.cli.server_process import ServerProcess
from chatd.observability.stats import percentiles

HERE = Path(__file__).parent
QUESTIONS = ["My internet is down since this morning.", "The router light is blinking orange.",
             "I restarted it twice already. What now?"]


def resident_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(re.search(r"VmRSS:\s+(\d+)", status).group(1)) / 1024


async def chat_round(url: str, customers: int, turns: int, max_new_tokens: int) -> tuple[list[float], int]:
    """Every customer chats `turns` turns at once; returns the TTFTs (ms) and the errors."""
    async def customer(index: int) -> tuple[list[float], int]:
        ttfts, errors = [], 0
        async with ChatClient(await connect(url)) as client:
            session_id = (await client.open_session(system="You are a support agent. Answer briefly.")).session_id
            for turn in range(turns):
                try:
                    done = await (await client.chat(session_id, QUESTIONS[turn % len(QUESTIONS)],
                                                    max_new_tokens=max_new_tokens)).result()
                    ttfts.append(done.timings.ttft_ms)
                except Exception:  # counted: the point is that there are none
                    errors += 1
        return ttfts, errors

    results = await asyncio.gather(*(customer(index) for index in range(customers)))
    return [t for ttfts, _ in results for t in ttfts], sum(errors for _, errors in results)


async def run(args: argparse.Namespace) -> dict:
    server = ServerProcess(args.serve)
    url, pid = server.url, server.process.pid
    try:
        await asyncio.sleep(1)
        loaded_mb = resident_mb(pid)
        quiet, quiet_errors = await chat_round(url, args.customers, args.turns, args.max_new_tokens)
        after_chat_mb = resident_mb(pid)
        idle = await asyncio.gather(*(connect(url, ping_interval=5, ping_timeout=20) for _ in range(args.idle)))
        await asyncio.sleep(2)
        with_idle_mb = resident_mb(pid)
        busy, busy_errors = await chat_round(url, args.customers, args.turns, args.max_new_tokens)
        still_open = sum(websocket.state.name == "OPEN" for websocket in idle)
        final_mb = resident_mb(pid)
        for websocket in idle:
            await websocket.close()
    finally:
        server.stop()
    return {
        "idle_connections": args.idle, "customers": args.customers, "turns": args.turns,
        "resident_mb": {"loaded": round(loaded_mb, 1), "after_chatting": round(after_chat_mb, 1),
                        "with_idle_connections": round(with_idle_mb, 1), "at_end": round(final_mb, 1)},
        "kb_per_idle_connection": round((with_idle_mb - after_chat_mb) * 1024 / args.idle, 1),
        "without_idle": {"ttft_ms": percentiles(quiet, scale=1.0), "errors": quiet_errors},
        "with_idle": {"ttft_ms": percentiles(busy, scale=1.0), "errors": busy_errors, "idle_still_open": still_open},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--idle", type=int, default=500, help="idle connections to hold open")
    parser.add_argument("--customers", type=int, default=16, help="customers chatting at once")
    parser.add_argument("--turns", type=int, default=3, help="turns per customer")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--serve", default="", help="extra flags for chatd serve")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "idle_connections.json")
    args = parser.parse_args()
    result = asyncio.run(run(args))
    print(result)
    write_result(args.output, result)


if __name__ == "__main__":
    main()
