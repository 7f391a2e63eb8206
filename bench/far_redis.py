"""Eight conversations streaming at once on a `--remote-kv` worker (SmolLM2, `chatd serve`) whose Redis is 0, 10 or
50 ms away (a proxy that delays every packet that many ms each way: a round trip takes twice that longer), against
a direct Redis: the decode tokens/s of the whole run and the longest gap between two streamed pieces of one reply
(the stall a customer sees). The engine must never wait on the network: a turn whose cache is in Redis waits in its
own state while the batch decodes on. Runs this checkout and, with --a-checkout DIR, another (the commit before, in
a `git worktree`), one after the other, alone on the machine.

    .venv/bin/python bench/far_redis.py --a-checkout /tmp/w/before [--delays 0 10 50] [--turns 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import checkouts, write_result

from chatd.cli.client import ChatClient
from chatd.cli.server_process import ServerProcess

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))
from tests.delay_proxy import DelayProxy  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

SYSTEM = "You are a support agent for Northwind Internet. Be helpful and precise."
QUESTIONS = ["My internet keeps dropping every evening.", "I restarted the router already.",
             "The lights on it blink orange.", "What should I try next?", "Can you send a technician?"]


async def conversation(url: str, number: int, turns: int, tokens: int) -> tuple[int, list[float], list[float]]:
    """One customer's turns: the tokens generated, the gaps between streamed pieces, and each turn's TTFT."""
    await asyncio.sleep(0.15 * number)  # (customers arrive one after another)
    async with await ChatClient.connect(url) as client:
        session_id = (await client.open_session(system=f"{SYSTEM} Customer {number}.")).session_id
        generated, gaps, ttfts = 0, [], []
        for turn_number in range(turns):
            turn = await client.chat(session_id, QUESTIONS[turn_number % len(QUESTIONS)], max_new_tokens=tokens,
                                     temperature=0)
            last = None
            async for _ in turn:
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now
            done = await turn.result()
            generated += done.usage.completion_tokens
            ttfts.append(done.timings.ttft_ms)
        return generated, gaps, ttfts


async def run(url: str, conversations: int, turns: int, tokens: int) -> dict:
    started = time.perf_counter()
    results = await asyncio.gather(*(conversation(url, number, turns, tokens) for number in range(conversations)))
    elapsed = time.perf_counter() - started
    gaps = [gap for _, each, _ in results for gap in each]
    ttfts = [ttft for _, _, each in results for ttft in each]
    return {"tokens_per_s": round(sum(generated for generated, _, _ in results) / elapsed, 1),
            "longest_gap_ms": round(1000 * max(gaps), 1), "p99_gap_ms": round(1000 * _p99(gaps), 1),
            "ttft_p50_ms": round(statistics.median(ttfts), 1), "wall_s": round(elapsed, 1)}


def _engine_stats(port: int) -> dict | None:
    """The engine's threads and Redis fetches, from /v1/stats (None where the checkout has no such figures)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/stats", timeout=30) as response:
        now = json.loads(response.read())["now"]
    engine = now.get("engine")
    return None if engine is None else {**engine, "fetches": now["tiers"]["remote"].get("fetches")}


def _p99(values: list[float]) -> float:
    return sorted(values)[min(len(values) - 1, int(0.99 * len(values)))]


def measure(checkout: Path, delays: list[int], conversations: int, turns: int, tokens: int, repeats: int) -> dict:
    """Every delay in turn, `repeats` times over (so that the machine's drift spreads over all of them): the median
    of each figure over the repeats."""
    runs: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory() as folder:
        redis = RedisServer(Path(folder))
        redis.start()
        try:
            for _ in range(repeats):
                for delay in delays:
                    with DelayProxy(redis.port, delay / 1000) as proxy:
                        url = redis.url if delay == 0 else proxy.url()
                        server = ServerProcess(f"--verify-sample-rate 0 --redis-url {url} --remote-kv",
                                               checkout=checkout)
                        try:
                            row = asyncio.run(run(server.url, conversations, turns, tokens))
                            row["engine"] = _engine_stats(server.port)
                        finally:
                            server.stop()
                    runs.setdefault("direct" if delay == 0 else f"{delay} ms away", []).append(row)
        finally:
            redis.stop()
    result = {}
    for name, rows in runs.items():
        result[name] = {key: statistics.median(row[key] for row in rows) for key in rows[0] if key != "engine"}
        result[name]["tokens_per_s (each run)"] = [row["tokens_per_s"] for row in rows]
        result[name]["longest_gap_ms (each run)"] = [row["longest_gap_ms"] for row in rows]
        result[name]["engine (last run)"] = rows[-1]["engine"]
    direct = result.get("direct")
    if direct is not None:
        for row in result.values():
            row["tokens_per_s / direct"] = round(row["tokens_per_s"] / direct["tokens_per_s"], 2)
            row["longest_gap / direct"] = round(row["longest_gap_ms"] / direct["longest_gap_ms"], 2)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--delays", type=int, nargs="+", default=[0, 10, 50], help="ms each way (0: direct)")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    report = {label: measure(checkout, args.delays, args.conversations, args.turns, args.tokens, args.repeats)
              for label, checkout in checkouts(HERE, args.a_checkout).items()}
    print(json.dumps(report, indent=2))
    write_result(HERE.parent / "results" / "far_redis.json", report)


if __name__ == "__main__":
    main()
