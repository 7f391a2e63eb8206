"""The session store's Redis latency on one Redis against a Redis Cluster (three primaries, three replicas), with
and without `WAIT` (issue 34), on real redis-servers this bench starts, one operation at a time:

- lookup: a session read (its meta, messages and token ids, one slot) and the prefix-index lookup of a resent
  conversation of ~1,000 tokens (its 64 blocks' keys span slots: on a cluster, pipelined per node);
- commit: a completed turn recorded (the append script; with `WAIT`, then `WAIT` for one replica on the same
  connection).

Run for this checkout and, with --a-checkout DIR, for another (the commit before, in a `git worktree`: its
configurations without `WAIT`), one after the other, alone on the machine.

    .venv/bin/python bench/redis_latency.py [--a-checkout /tmp/w/base] [--ops 2000]
"""

from __future__ import annotations

import argparse
import json
from contextlib import contextmanager
from pathlib import Path

from common import checkouts, in_checkout, write_result

HERE = Path(__file__).resolve()
CONFIGS = ("single", "single+replica WAIT 1", "cluster", "cluster WAIT 1")
SESSIONS = 50
CONVERSATION_TOKENS = 1024


def worker(ops: int) -> dict:
    """The measurement in this process (the checkout on PYTHONPATH): every configuration it can run."""
    import asyncio
    import inspect
    import tempfile

    from sessions.redis_store import RedisSessionStore
    from sessions.shared_prefix_index import SharedPrefixIndex
    from tests.redis_cluster import RedisClusterNodes

    can_wait = "wait_replicas" in inspect.signature(RedisSessionStore).parameters
    report = {}
    with tempfile.TemporaryDirectory() as folder, _redis_server(Path(folder) / "single") as single:
        with _redis_server(Path(folder) / "replica", "--replicaof", "127.0.0.1", str(single)):
            cluster = RedisClusterNodes(Path(folder) / "cluster")
            cluster.start()
            try:
                for config in CONFIGS:
                    wait = 1 if "WAIT" in config else 0
                    if wait and not can_wait:
                        continue
                    on_cluster = config.startswith("cluster")
                    url = cluster.url if on_cluster else f"redis://127.0.0.1:{single}/0"
                    options = {"wait_replicas": wait} if can_wait else {}
                    store = RedisSessionStore(url, 3600, cluster=on_cluster, **options)
                    report[config] = asyncio.run(_measure(store, SharedPrefixIndex, ops))
            finally:
                cluster.stop()
    return report


@contextmanager
def _redis_server(folder: Path, *options: str):
    """A redis-server on a free port, persisting nothing (as the cluster's nodes), until the block ends: its port."""
    import subprocess
    import time

    import redis

    from chatd.cli.server_process import free_port

    folder.mkdir()
    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                                "--save", "", "--appendonly", "no", "--repl-diskless-sync-delay", "0", *options],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                info = redis.Redis(port=port).info("replication")
                if info["role"] == "master" or info.get("master_link_status") == "up":
                    break
            except redis.ConnectionError:
                pass
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        yield port
    finally:
        process.terminate()
        process.wait(10)


async def _measure(store, index_class, ops: int) -> dict:
    import time

    index = index_class(store.client, 3600)
    conversations = []
    for number in range(SESSIONS):
        session = await store.create("Be brief.", owner="bench")
        ids = [(number * 7919 + position) % 49152 for position in range(CONVERSATION_TOKENS)]
        await index.add("bench", session.session_id, ids)
        conversations.append((session, ids))
    samples: dict[str, list[float]] = {"session read": [], "prefix lookup": [], "turn commit": []}
    for op in range(ops):
        session, ids = conversations[op % SESSIONS]
        for name, call in (("session read", lambda session=session: store.get(session.session_id)),
                           ("prefix lookup", lambda ids=ids: index.candidates("bench", ids)),
                           ("turn commit", lambda session=session, ids=ids: store.append_turn(
                               session, "Where is my parcel?", "It is on its way.", ids))):
            started = time.perf_counter()
            await call()
            samples[name].append(time.perf_counter() - started)
    await store.close()
    return {name: _percentiles(values) for name, values in samples.items()}


def _percentiles(values: list[float]) -> dict[str, float]:
    ordered = sorted(values)
    return {f"p{p}_ms": round(1000 * ordered[min(len(ordered) - 1, len(ordered) * p // 100)], 3)
            for p in (50, 90, 99)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a-checkout", type=Path, default=None, help="also measure this checkout (before)")
    parser.add_argument("--ops", type=int, default=2000, help="operations of each kind per configuration")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--output", type=Path, default=Path("bench/results/redis-latency.json"))
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.ops)))
        return
    result = {name: in_checkout(HERE, checkout, "--ops", str(args.ops))
              for name, checkout in checkouts(HERE, args.a_checkout).items()}
    for name, configs in result.items():
        for config, operations in configs.items():
            print(f"{name:6} {config:22} " + "  ".join(
                f"{operation} {figures['p50_ms']:.3f}/{figures['p99_ms']:.3f}" for operation, figures in
                operations.items()) + "  (p50/p99 ms)")
    write_result(args.output, result)


if __name__ == "__main__":
    main()
