"""Capacity and speed of the int8 host and remote tiers against exact copies, with SmolLM2's cache
geometry in float32: sessions per GB of host memory, the time of a restore (checks included) from the
host tier and from Redis, and Redis bytes per session, at several history lengths.

Runs the cache store itself (no model: caches of random values with SmolLM2's shape) and its own
redis-server.

    .venv/bin/python bench/int8_capacity.py [--tokens 512 2048] [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from common import write_result
from transformers import DynamicCache

from cache_store import CacheEntry, CacheLayout, CacheQuery, CacheStore, Offloader
from cache_store.remote.remote_format import EVERY_VERSION
from cache_store.remote.remote_tier import RemoteTier

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.redis_server import RedisServer  # noqa: E402

HERE = Path(__file__).parent
LAYOUT = CacheLayout(layers=30, kv_heads=3, head_dim=64, dtype=torch.float32)  # SmolLM2-135M
GB = 2**30


def make_entry(tokens: int) -> CacheEntry:
    cache = DynamicCache()
    for layer in range(LAYOUT.layers):
        keys = torch.randn(1, LAYOUT.kv_heads, tokens, LAYOUT.head_dim)
        cache.update(keys, torch.randn_like(keys), layer)
    return CacheEntry(cache, list(range(tokens)))


def store(kv_dtype: str, remote: RemoteTier | None = None) -> CacheStore:
    return CacheStore(new_cache=lambda tokens: DynamicCache(), offloader=Offloader(torch.device("cpu")), layout=LAYOUT,
                      model_key="bench", device_budget_bytes=8 * GB, host_budget_bytes=8 * GB,
                      host_kv_dtype=kv_dtype, remote=remote, remote_kv_dtype=kv_dtype)


def host_round(kv_dtype: str, tokens: int) -> tuple[float, float, int]:
    """(offload s, restore s with its checks, host bytes held) of one cache."""
    tier = store(kv_dtype)
    tier.put("s", make_entry(tokens))
    started = time.perf_counter()
    tier.evict_idle()
    offload_s = time.perf_counter() - started
    held = tier.host.used_bytes()
    started = time.perf_counter()
    lookup = tier.lookup(CacheQuery("s", list(range(tokens)) + [0]))
    restore_s = time.perf_counter() - started
    assert lookup.source == "host", lookup
    return offload_s, restore_s, held


def remote_round(kv_dtype: str, tokens: int, url: str) -> tuple[float, int]:
    """(restore s from Redis with its checks, bytes in Redis) of one cache."""
    writer = RemoteTier(url, ttl_s=600)
    store(kv_dtype, writer).put("s", make_entry(tokens))
    writer.close()  # the background write is done
    reader = RemoteTier(url, ttl_s=600)
    nbytes = reader.head("s").nbytes
    started = time.perf_counter()
    lookup = store(kv_dtype, reader).lookup(CacheQuery("s", list(range(tokens)) + [0]))
    restore_s = time.perf_counter() - started
    assert lookup.source == "remote", lookup
    reader.delete("s", EVERY_VERSION)
    reader.close()
    return restore_s, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "int8_capacity.json")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        redis_server = RedisServer(Path(folder))
        redis_server.start()
        try:
            for tokens in args.tokens:
                for kv_dtype in ("same", "int8"):
                    host = [host_round(kv_dtype, tokens) for _ in range(args.repeats)]
                    remote = [remote_round(kv_dtype, tokens, redis_server.url) for _ in range(args.repeats)]
                    held = host[0][2]
                    rows.append({"tokens": tokens, "kv_dtype": kv_dtype, "host_bytes": held,
                                 "sessions_per_gb": GB // held,
                                 "offload_ms": 1000 * statistics.median(h[0] for h in host),
                                 "host_restore_ms": 1000 * statistics.median(h[1] for h in host),
                                 "redis_restore_ms": 1000 * statistics.median(r[0] for r in remote),
                                 "redis_bytes": remote[0][1]})
                    row = rows[-1]
                    print(f"{tokens:>5} tokens {kv_dtype:<4}: host {held / 2**20:6.1f} MB ({row['sessions_per_gb']} "
                          f"per GB), offload {row['offload_ms']:6.1f} ms, restore from host "
                          f"{row['host_restore_ms']:6.1f} ms, from Redis {row['redis_restore_ms']:6.1f} ms "
                          f"({row['redis_bytes'] / 2**20:.1f} MB in Redis)", flush=True)
        finally:
            redis_server.stop()
    write_result(args.output, {"layout": "SmolLM2-135M float32", "rows": rows})


if __name__ == "__main__":
    main()
