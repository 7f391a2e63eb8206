"""One stream's decode tokens/s, alone and beside a busy process (`python -c "while True: pass"`, as any busy
neighbour on the box: a benchmark client, a Redis or nginx under load), through `chatd serve` with SmolLM2: for this
checkout and, with --a-checkout DIR, for another (the commit before, in a `git worktree`), one after the other,
alone on the machine. torch's threads spin-wait for each other: with one of them descheduled, every step stalls.

    .venv/bin/python bench/busy_neighbour.py --a-checkout /tmp/w/before [--turns 4] [--tokens 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

from common import checkouts, write_result

from chatd.cli.client import ChatClient
from chatd.cli.server_process import ServerProcess

HERE = Path(__file__).resolve()
QUESTIONS = ["My internet keeps dropping every evening.", "I restarted the router already.",
             "The lights on it blink orange.", "What should I try next?"]


async def decode_rates(url: str, turns: int, tokens: int) -> list[float]:
    """Decode tokens/s of each turn of one conversation (after a warm-up turn)."""
    async with await ChatClient.connect(url) as client:
        session_id = (await client.open_session(system="You are a support agent for Northwind Internet.")).session_id
        await (await client.chat(session_id, "Hello.", max_new_tokens=8)).result()
        rates = []
        for number in range(turns):
            turn = await client.chat(session_id, QUESTIONS[number % len(QUESTIONS)], max_new_tokens=tokens,
                                     temperature=0)
            done = await turn.result()
            rates.append(done.timings.tokens_per_s)
        return rates


def measure(checkout: Path, turns: int, tokens: int) -> dict:
    """Alone, then beside a busy process (which starts first and runs for the whole measure)."""
    result = {}
    server = ServerProcess("--verify-sample-rate 0", checkout=checkout)
    try:
        result["alone"] = asyncio.run(decode_rates(server.url, turns, tokens))
        busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
        try:
            time.sleep(2.0)  # (as a neighbour would be: there before the turns)
            result["beside a busy process"] = asyncio.run(decode_rates(server.url, turns, tokens))
        finally:
            busy.kill()
            busy.wait(10)
        result["alone again"] = asyncio.run(decode_rates(server.url, turns, tokens))
    finally:
        server.stop()
    medians = {name: round(statistics.median(rates), 1) for name, rates in result.items()}
    return {"tokens_per_s": medians, "every_turn": {name: [round(rate, 1) for rate in rates]
                                                   for name, rates in result.items()},
            "beside / alone": round(medians["beside a busy process"] / medians["alone"], 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    report = {label: measure(checkout, args.turns, args.tokens)
              for label, checkout in checkouts(HERE, args.a_checkout).items()}
    print(json.dumps(report, indent=2))
    write_result(HERE.parent / "results" / "busy_neighbour.json", report)


if __name__ == "__main__":
    main()
