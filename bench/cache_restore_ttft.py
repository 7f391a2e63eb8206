"""Time to first token of a turn with a long history: cache resident on the device, restored from
the host tier, and recomputed from scratch, side by side in one run.

Runs an in-process server with the real model, gives one session a synthetic customer-service
history of about --history-tokens tokens, then alternates: a turn with the cache resident; a turn
after every cache was offloaded to the host tier; a turn after the cache was dropped.

    .venv/bin/python bench/cache_restore_ttft.py [--history-tokens 2048] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from common import synthetic_history, write_result

from cache_store import Offloader
from chatd.api.server import ChatServer
from chatd.cli.client import ChatClient
from chatd.config import Settings
from chatd.model.loader import load_model
from chatd.model.prompt import PromptRenderer

HERE = Path(__file__).parent


async def measure(args: argparse.Namespace) -> dict:
    scenario = json.loads(args.scenario.read_text())
    loaded = load_model("smollm2-135m", device=args.device)
    history = synthetic_history(scenario, PromptRenderer(loaded.tokenizer), args.history_tokens)
    samples: dict[str, list[float]] = {"device": [], "host": [], "miss": []}
    prompt_tokens: list[int] = []
    async with ChatServer(Settings(port=0, device=args.device), load=lambda: loaded) as server:
        await server.wait_ready()
        session = await server.sessions.create(scenario["system"])
        session.messages = list(history)
        async with await ChatClient.connect(server.url) as client:
            await client.open_session(session_id=session.session_id)
            warm = await (await client.chat(session.session_id, "Hello again.", max_new_tokens=1)).result()
            print(f"history: {warm.usage.prompt_tokens} prompt tokens, first prefill {warm.timings.ttft_ms:.0f} ms",
                  file=sys.stderr)
            for round_index in range(args.rounds):
                for source, prepare in (("device", None), ("host", server.engine.offload_idle),
                                        ("miss", lambda: server.engine.drop_cache(session.session_id))):
                    if prepare:
                        prepare()
                    done = await (await client.chat(session.session_id, "One more question about my bill.",
                                                    max_new_tokens=1)).result()
                    assert done.cache.source == source, (source, done.cache)
                    samples[source].append(done.timings.ttft_ms)
                    prompt_tokens.append(done.usage.prompt_tokens)
                print(f"round {round_index + 1}/{args.rounds} done", file=sys.stderr)
        entry = server.engine.cache.device.get(session.session_id)
        copy = copy_bandwidth(entry, loaded.device, server.engine.runner.new_cache)
    medians = {source: statistics.median(values) for source, values in samples.items()}
    return {"device": str(loaded.device), "dtype": str(loaded.model.dtype), "torch_threads": torch.get_num_threads(),
            "prompt_tokens": [min(prompt_tokens), max(prompt_tokens)], "ttft_ms": samples,
            "median_ttft_ms": medians, "host_over_device": medians["host"] / medians["device"],
            "recompute_over_host": medians["miss"] / medians["host"], **copy}


def copy_bandwidth(entry, device: torch.device, new_cache, repeats: int = 5) -> dict:
    """Offload (with its checksum) and restore of one cache through the same code the tiers use
    (medians: the first copies also pay for fresh memory pages)."""
    offloader = Offloader(device)
    offloads, restores = [], []
    for _ in range(repeats):
        started = time.perf_counter()
        host = offloader.offload(entry)
        offloads.append(time.perf_counter() - started)
        started = time.perf_counter()
        offloader.restore(host, new_cache)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        restores.append(time.perf_counter() - started)
    offload_s, restore_s = statistics.median(offloads), statistics.median(restores)
    return {"cache_tokens": entry.num_tokens, "cache_mb": host.nbytes / 2**20,
            "offload_ms": offload_s * 1000, "restore_ms": restore_s * 1000,
            "offload_gb_s": host.nbytes / offload_s / 1e9, "restore_gb_s": host.nbytes / restore_s / 1e9}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", type=Path, default=HERE / "scenarios" / "internet_support.json")
    parser.add_argument("--history-tokens", type=int, default=2048)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "cache_restore_ttft.json")
    args = parser.parse_args()
    result = asyncio.run(measure(args))
    medians = result["median_ttft_ms"]
    print(f"prompt tokens {result['prompt_tokens'][0]}-{result['prompt_tokens'][1]} on {result['device']} "
          f"({result['dtype']}), medians of {args.rounds}:")
    print(f"  TTFT resident on device   {medians['device']:8.1f} ms")
    print(f"  TTFT restored from host   {medians['host']:8.1f} ms   ({result['host_over_device']:.2f}x resident)")
    print(f"  TTFT full recompute       {medians['miss']:8.1f} ms   ({result['recompute_over_host']:.1f}x restored)")
    print(f"  copy of a {result['cache_tokens']}-token cache ({result['cache_mb']:.1f} MB): offload "
          f"{result['offload_ms']:.1f} ms ({result['offload_gb_s']:.2f} GB/s), restore {result['restore_ms']:.1f} ms "
          f"({result['restore_gb_s']:.2f} GB/s)")
    write_result(args.output, result)


if __name__ == "__main__":
    main()
