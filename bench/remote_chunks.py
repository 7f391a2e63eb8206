"""Two workers sharing one Redis (`--remote-kv`) serve one SmolLM2 conversation turn by turn, A, B, A, B...
(the ten turns of the internet-support scenario): each turn continues on its worker from Redis. Per turn: what
the worker already held, the bytes Redis sent it (its `total_net_output_bytes`) and the fetch's time, the bytes
the write-back sent Redis and its time. With chains of chunks a worker fetches only the chunks after the copy it
holds from two turns before, and a write sends only the turn's new chunks. Run for this checkout and, with
--a-checkout DIR, for another (the commit before, in a `git worktree`), one after the other, alone on the machine;
--chunk-tokens measures several chunk sizes on this checkout.

    .venv/bin/python bench/remote_chunks.py --a-checkout /tmp/w/old [--chunk-tokens 16 32 64 128 256]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import checkouts, in_checkout, write_result

HERE = Path(__file__).resolve()
TURNS = (2, 5, 8, 10)


def worker(chunk_tokens: str) -> dict:
    """The measurement in this process (the checkout on PYTHONPATH); chunk_tokens "default": the checkout's own."""
    import tempfile
    import time

    import redis
    import torch

    from chatd.config import Settings
    from chatd.model.loader import load_model
    from sessions import Session
    from tests.redis_server import RedisServer
    from tests.support import running_engine

    torch.manual_seed(0)
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    scenario = json.loads((HERE.parent / "scenarios" / "internet_support.json").read_text())
    chunked = {} if chunk_tokens == "default" else {"remote_kv_chunk_tokens": int(chunk_tokens)}
    if chunked and "remote_kv_chunk_tokens" not in Settings.model_fields:
        raise SystemExit("this checkout has no chunks")
    report = {}
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder))
        server.start()
        client = redis.Redis.from_url(server.url)

        def net() -> tuple[int, int]:
            stats = client.info("stats")
            return stats["total_net_input_bytes"], stats["total_net_output_bytes"]

        try:
            settings = {"verify_sample_rate": 0.0, "redis_url": server.url, "remote_kv": True, **chunked}
            with running_engine(loaded, **settings) as a, running_engine(loaded, **settings) as b:
                fetches: list[float] = []
                for engine in (a, b):
                    engine.call(lambda store: (setattr(store.cost, "prefill_tokens_per_s", 1.0), setattr(
                        store, "on_copy", lambda direction, tier, seconds: fetches.append(seconds)
                        if (direction, tier) == ("restore", "remote") else None))).result()
                session = Session("customer", system=scenario["system"])
                for turn, content in enumerate(scenario["turns"], start=1):
                    engine = (a, b)[(turn - 1) % 2]
                    held = engine.call(lambda store: (entry := store.device.get("customer")) and entry.num_tokens
                                       ).result() or 0
                    fetches.clear()
                    sent_before = net()[1]
                    done = _run_turn(engine, session, content)
                    fetched = net()[1] - sent_before
                    received_before, started = net()[0], time.perf_counter()
                    engine.wait_shared("customer", 60)
                    write_s = time.perf_counter() - started
                    report[turn] = {"tokens": len(done.conversation_ids), "held_tokens": held,
                                    "source": done.cache_source, "cached_tokens": done.cached_tokens,
                                    "fetch_bytes": fetched, "fetch_ms": round(1000 * sum(fetches), 2),
                                    "write_bytes": net()[0] - received_before, "write_ms": round(1000 * write_s, 2)}
            keys = client.dbsize()
        finally:
            client.close()
            server.stop()
    later = [report[turn] for turn in range(2, len(report) + 1)]
    means = {key: round(statistics.fmean(row[key] for row in later), 2)
             for key in ("fetch_bytes", "fetch_ms", "write_bytes", "write_ms")}
    return {**{str(turn): report[turn] for turn in TURNS}, "mean of turns 2-10": means, "redis_keys": keys}


def full_fetch(tokens: int, sizes: list[int], repeats: int = 5) -> dict:
    """A fresh worker fetching a whole SmolLM2-sized cache of `tokens` positions (random keys and values, float32)
    from a redis-server of its own, per chunk size: the median time of the lookup (fetch, checks, copy) and the
    keys it reads, so that small chunks' extra keys are priced too."""
    import statistics
    import tempfile
    import time

    import torch
    from transformers import DynamicCache

    from cache_store import CacheEntry, CacheLayout, CacheQuery, CacheStore, Offloader
    from cache_store.remote.remote_tier import RemoteTier
    from tests.redis_server import RedisServer

    layout = CacheLayout(30, 3, 64, torch.float32)
    cache = DynamicCache()
    for layer in range(layout.layers):
        keys = torch.randn(1, layout.kv_heads, tokens, layout.head_dim)
        cache.update(keys, keys + 1, layer)

    def store(remote: RemoteTier) -> CacheStore:
        made = CacheStore(new_cache=lambda n: DynamicCache(), offloader=Offloader(torch.device("cpu")), layout=layout,
                          model_key="bench", device_budget_bytes=2**34, host_budget_bytes=2**34, remote=remote)
        made.cost.prefill_tokens_per_s = 1.0
        return made

    result = {}
    with tempfile.TemporaryDirectory() as folder:
        server = RedisServer(Path(folder))
        server.start()
        try:
            for size in sizes:
                writer = RemoteTier(server.url, ttl_s=600, chunk_tokens=size)
                writing = store(writer)
                writing.lookup(CacheQuery("s", [1, 2]))
                writing.put("s", CacheEntry(cache, list(range(tokens))))
                writer.close()
                samples = []
                for _ in range(repeats):
                    reader = RemoteTier(server.url, ttl_s=600, chunk_tokens=size)
                    started = time.perf_counter()
                    found = store(reader).lookup(CacheQuery("s", [*range(tokens), 0]))
                    samples.append(time.perf_counter() - started)
                    assert found.source == "remote", found
                    reader.close()
                result[str(size)] = {"keys": -(-tokens // size) + 1,
                                     "fetch_ms": round(1000 * statistics.median(samples), 1)}
                writer._redis.flushdb()
        finally:
            server.stop()
    return {"tokens": tokens, "chunk_tokens": result}


def _run_turn(engine, session, content: str):
    """One turn carrying the session's version, as the gateway sends it (so that a worker knows its copy from two
    turns before is older than Redis's); recorded in `session`."""
    import threading

    from chatd.engine.sampling import SamplingParams
    from chatd.engine.turn import TokenText, Turn

    finished, results = threading.Event(), []

    def emit(event) -> None:
        if not isinstance(event, TokenText):
            results.append(event)
            finished.set()

    engine.submit(Turn(turn_id=f"t{len(session.messages)}", session_id=session.session_id,
                       messages=session.prompt_messages(content), params=SamplingParams(max_new_tokens=32),
                       emit=emit, session_version=session.version))
    assert finished.wait(300), "the engine did not finish the turn"
    session.record_turn(content, results[0].content)
    return results[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--chunk-tokens", nargs="+", default=[], help="chunk sizes to measure on this checkout")
    parser.add_argument("--full-fetch", type=int, metavar="TOKENS", help="instead: a fresh worker fetching a whole "
                        "cache of TOKENS positions, per --chunk-tokens size")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    if args.full_fetch:
        report = full_fetch(args.full_fetch, [int(size) for size in args.chunk_tokens or [16, 32, 64, 128, 256]])
        print(json.dumps(report, indent=2))
        write_result(HERE.parent / "results" / "remote_chunks_full_fetch.json", report)
        return
    report = {label: in_checkout(HERE, checkout, "default")
              for label, checkout in checkouts(HERE, args.a_checkout).items()}
    for size in args.chunk_tokens:
        report[f"after, {size}-token chunks"] = in_checkout(HERE, HERE.parent.parent, size)
    print(json.dumps(report, indent=2))
    write_result(HERE.parent / "results" / "remote_chunks.json", report)


if __name__ == "__main__":
    main()
