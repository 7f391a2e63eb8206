"""What a far Redis adds to one turn: a conversation of short turns (4 tokens) on a `--remote-kv` worker whose Redis
is behind a proxy that delays every packet `--delay-ms` each way, the client's end-to-end time per turn against
the engine's own (`timings.total_ms`), and the Redis commands each turn ran (scripts counted with the commands
they ran). For this checkout and, with --a-checkout DIR, the commit before.

    .venv/bin/python bench/turn_round_trips.py --a-checkout /tmp/w/before [--delay-ms 50] [--turns 6]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import redis
from common import checkouts, write_result

from chatd.cli.client import ChatClient
from chatd.cli.server_process import ServerProcess

HERE = Path(__file__).resolve()
sys.path.insert(0, str(HERE.parent.parent))
from tests.delay_proxy import DelayProxy  # noqa: E402
from tests.redis_server import RedisServer  # noqa: E402

QUESTIONS = ["Hello.", "My router blinks.", "It is orange.", "Since Monday.", "Thanks.", "Bye."]


async def turns(url: str, count: int, direct: redis.Redis) -> list[dict]:
    async with await ChatClient.connect(url) as client:
        session_id = (await client.open_session(system="Be brief.")).session_id
        rows = []
        for number in range(count):
            direct.config_resetstat()
            started = time.perf_counter()
            done = await (await client.chat(session_id, QUESTIONS[number % len(QUESTIONS)], max_new_tokens=4)).result()
            commands = {name.removeprefix("cmdstat_"): stats["calls"]
                        for name, stats in direct.info("commandstats").items() if name != "cmdstat_config|resetstat"}
            rows.append({"end_to_end_ms": 1000 * (time.perf_counter() - started),
                         "engine_ms": done.timings.total_ms, "commands": sum(commands.values()),
                         "scripts": commands.get("eval", 0)})
        return rows


def measure(checkout: Path, delay_ms: int, count: int) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder))
        server.start()
        try:
            with DelayProxy(server.port, delay_ms / 1000) as proxy:
                flags = f"--verify-sample-rate 0 --redis-url {proxy.url()} --remote-kv"
                chatd = ServerProcess(flags, checkout=checkout)
                try:
                    rows = asyncio.run(turns(chatd.url, count, redis.Redis(port=server.port)))
                finally:
                    chatd.stop()
        finally:
            server.stop()
    later = rows[1:]  # (the first turn creates what the others continue)
    return {"end_to_end_ms": round(statistics.median(row["end_to_end_ms"] for row in later), 1),
            "engine_ms": round(statistics.median(row["engine_ms"] for row in later), 1),
            "redis_commands": statistics.median(row["commands"] for row in later),
            "redis_scripts": statistics.median(row["scripts"] for row in later)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--delay-ms", type=int, default=50, help="ms each way")
    parser.add_argument("--turns", type=int, default=6)
    args = parser.parse_args()
    report = {label: measure(checkout, args.delay_ms, args.turns)
              for label, checkout in checkouts(HERE, args.a_checkout).items()}
    print(json.dumps(report, indent=2))
    write_result(HERE.parent / "results" / "turn_round_trips.json", report)


if __name__ == "__main__":
    main()
