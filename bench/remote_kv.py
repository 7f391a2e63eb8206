"""Remote KV tier: time to first token when a worker restores a session's cache from Redis,
against recomputing the same history, at several history lengths; and the cost model's choice.

Starts its own redis-server, then per history length: worker A serves one turn of two sessions
with the same synthetic history (writing both caches to Redis); worker B (remote tier on) serves
the next turn of the first session, worker C (remote tier off) of the second, so both answer the
same prompt, one from Redis and one by recomputing.

    .venv/bin/python bench/remote_kv.py [--history-tokens 512 2048]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path

import redis.asyncio as redis
from common import synthetic_history, write_result

from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.model.loader import load_model
from chatd.model.prompt import PromptRenderer

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.redis_server import RedisServer  # noqa: E402

HERE = Path(__file__).parent


async def wait_for_remote(url: str, session_id: str) -> None:
    client = redis.Redis.from_url(url)
    while not await client.exists(f"chatd:{{{session_id}}}:kvmeta"):
        await asyncio.sleep(0.02)
    await client.aclose()


async def one_length(loaded, scenario: dict, url: str, tokens: int) -> dict:
    history = synthetic_history(scenario, PromptRenderer(loaded.tokenizer), tokens)
    with_remote = Settings(port=0, redis_url=url, remote_kv=True)
    async with ChatServer(with_remote, load=lambda: loaded) as a, ChatServer(with_remote, load=lambda: loaded) as b, \
            ChatServer(Settings(port=0, redis_url=url), load=lambda: loaded) as c:
        for server in (a, b, c):
            await server.wait_ready()
        sessions = []
        for _ in range(2):
            session = await a.sessions.create(scenario["system"])
            for user, reply in zip(history[0::2], history[1::2], strict=True):
                await a.sessions.append_turn(session, user.content, reply.content, [])
            sessions.append(session.session_id)
        async with await ChatClient.connect(a.url) as client:
            for session_id in sessions:
                await (await client.chat(session_id, "Hello again.", max_new_tokens=1)).result()
                await wait_for_remote(url, session_id)
        results = {}
        for server, session_id, label in ((b, sessions[0], "remote"), (c, sessions[1], "recompute")):
            async with await ChatClient.connect(server.url) as client:
                await client.open_session(session_id=session_id)
                done = await (await client.chat(session_id, "One more question about my bill.",
                                                max_new_tokens=1)).result()
                results[label] = done
    remote, recompute = results["remote"], results["recompute"]
    assert remote.cache.source == "remote" and recompute.cache.source == "miss"
    return {"history_tokens": remote.usage.prompt_tokens, "ttft_remote_ms": remote.timings.ttft_ms,
            "ttft_recompute_ms": recompute.timings.ttft_ms, "choice": remote.cache.remote.choice,
            "estimated_fetch_ms": remote.cache.remote.fetch_ms, "estimated_prefill_ms": remote.cache.remote.prefill_ms}


async def measure(args: argparse.Namespace) -> list[dict]:
    scenario = json.loads(args.scenario.read_text())
    loaded = load_model("smollm2-135m", device=args.device)
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder))
        server.start()
        try:
            return [await one_length(loaded, scenario, server.url, tokens) for tokens in args.history_tokens]
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", type=Path, default=HERE / "scenarios" / "internet_support.json")
    parser.add_argument("--history-tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "remote_kv.json")
    args = parser.parse_args()
    rows = asyncio.run(measure(args))
    print(f"{'prompt':>6} {'TTFT remote':>12} {'TTFT recompute':>15} {'ratio':>6}  cost model: choice "
          f"(estimated fetch / prefill)")
    for row in rows:
        print(f"{row['history_tokens']:>6} {row['ttft_remote_ms']:>10.1f}ms {row['ttft_recompute_ms']:>13.1f}ms "
              f"{row['ttft_recompute_ms'] / row['ttft_remote_ms']:>5.1f}x  {row['choice']} "
              f"({row['estimated_fetch_ms']:.1f} ms / {row['estimated_prefill_ms']:.1f} ms)")
    write_result(args.output, rows)


if __name__ == "__main__":
    main()
