"""int8 host tier end to end: four customers taking turns (four turns each) on a `chatd` server with a
device budget of about one conversation and a host budget of two full-precision caches, in int8, against
an unlimited exact server: how many of the 16 replies are identical, and where each int8 turn's cache came
from. Run it against the commit before with `git worktree` (docs/benchmarks.md).

    .venv/bin/python bench/int8_interleaved.py
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from common import write_result
from websockets.asyncio.client import connect

from cache_store import kv_bytes_per_token
from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.model.loader import load_model

HERE = Path(__file__).parent
SYSTEM = "You are a friendly customer-service agent for Northwind Internet. Answer briefly."
INTERLEAVED = {
    "billing": ["I was charged twice this month.", "The second charge is 29.99.", "Please refund it.",
                "When will I see the money?"],
    "outage": ["My internet is down.", "The router light is red.", "I restarted it, still red.",
               "Can a technician come tomorrow?"],
    "moving": ["I am moving house next month.", "The new address is 4 Elm Road.", "Can I keep my number?",
               "What does the move cost?"],
    "upgrade": ["I want faster internet.", "What plans do you have?", "How much is the fastest one?",
                "Sign me up for it."],
}


async def interleaved(loaded) -> dict:
    """The four customers in turn on an int8 server under small budgets and on an unlimited exact one."""
    token_mb = kv_bytes_per_token(loaded.model.config, loaded.model.dtype) / 2**20
    replies: dict[str, list] = {}
    for label, settings in (("exact", Settings(port=0)),
                            ("int8", Settings(port=0, device_cache_mb=256 * token_mb, host_cache_mb=400 * token_mb,
                                              host_kv_dtype="int8"))):
        async with ChatServer(settings, load=lambda: loaded) as server:
            await server.wait_ready()
            async with ChatClient(await connect(server.url)) as client:
                sessions = {name: (await client.open_session(system=SYSTEM)).session_id for name in INTERLEAVED}
                replies[label] = [await (await client.chat(sessions[name], questions[turn], max_new_tokens=24))
                                  .result() for turn in range(4) for name, questions in INTERLEAVED.items()]
    same = sum(a.content == b.content for a, b in zip(replies["exact"], replies["int8"], strict=True))
    return {"identical": f"{same} of {len(replies['int8'])}",
            "int8_sources": [f"{d.cache.source}{'/int8' if d.cache.quantized else ''}" for d in replies["int8"]]}


def main() -> None:
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    summary = asyncio.run(interleaved(loaded))
    print(json.dumps(summary, indent=2))
    write_result(HERE / "results" / "int8_interleaved.json", summary)


if __name__ == "__main__":
    main()
