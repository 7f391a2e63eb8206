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
    from tests.support import run_turn, running_engine

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
                    done, _ = run_turn(engine, session, content, max_new_tokens=32)
                    fetched = net()[1] - sent_before
                    received_before, started = net()[0], time.perf_counter()
                    engine.wait_shared("customer", 60)
                    write_s = time.perf_counter() - started
                    report[turn] = {"tokens": len(done.conversation_ids), "held_tokens": held,
                                    "source": done.cache.source, "cached_tokens": done.cache.cached_tokens,
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--chunk-tokens", nargs="+", default=[], help="chunk sizes to measure on this checkout")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    report = {label: in_checkout(HERE, checkout, "default")
              for label, checkout in checkouts(HERE, args.a_checkout).items()}
    for size in args.chunk_tokens:
        report[f"after, {size}-token chunks"] = in_checkout(HERE, HERE.parent.parent, size)
    print(json.dumps(report, indent=2))
    write_result(HERE.parent / "results" / "remote_chunks.json", report)


if __name__ == "__main__":
    main()
