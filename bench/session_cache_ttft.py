"""Time to first token per turn, with and without the session cache, against raw model calls.

Starts two `chatd serve` processes (session cache on, and --no-session-cache), plays one scripted
customer-service conversation on both, alternating turn by turn, then times the same prefills with
raw model calls in this process. Prints one row per turn and writes a JSON result.

    .venv/bin/python bench/session_cache_ttft.py [--repeats 3] [--max-new-tokens 48]
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
from common import write_result
from transformers import DynamicCache

from chatd.cli.client import ChatClient
from chatd.cli.server_process import ServerProcess
from chatd.model.loader import load_model
from chatd.model.prompt import PromptRenderer
from sessions import Session

HERE = Path(__file__).parent


async def play(scenario: dict, cached_url: str, uncached_url: str, max_new_tokens: int) -> list[dict]:
    """One pass of the conversation on both servers, alternating; returns one row per turn."""
    rows = []
    async with await ChatClient.connect(cached_url) as cached, await ChatClient.connect(uncached_url) as uncached:
        session_a = (await cached.open_session(system=scenario["system"])).session_id
        session_b = (await uncached.open_session(system=scenario["system"])).session_id
        for content in scenario["turns"]:
            hit = await (await cached.chat(session_a, content, max_new_tokens=max_new_tokens)).result()
            miss = await (await uncached.chat(session_b, content, max_new_tokens=max_new_tokens)).result()
            rows.append({"prompt_tokens": hit.usage.prompt_tokens, "cached_tokens": hit.usage.cached_tokens,
                         "source": hit.cache.source, "ttft_cached_ms": hit.timings.ttft_ms,
                         "ttft_uncached_ms": miss.timings.ttft_ms, "same_reply": hit.content == miss.content,
                         "reply": hit.content})
    return rows


def raw_prefill_times(scenario: dict, replies: list[str], repeats: int) -> list[dict]:
    """Median prefill time of each turn's prompt with plain model calls: the whole prompt, and only
    the tokens after the previous turn's ids on top of a cache of them."""
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    renderer = PromptRenderer(loaded.tokenizer)
    session = Session("bench", system=scenario["system"])
    previous: list[int] = []
    rows = []

    def prefill(ids: list[int], cache: DynamicCache) -> None:
        loaded.model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True, logits_to_keep=1)

    with torch.inference_mode():
        for content, reply in zip(scenario["turns"], replies, strict=True):
            prompt = renderer.render(session.prompt_messages(content))
            full, incremental = [], []
            for _ in range(repeats):
                started = time.perf_counter()
                prefill(prompt, DynamicCache(config=loaded.model.config))
                full.append(time.perf_counter() - started)
                reused = min(len(previous), len(prompt) - 1)
                cache = DynamicCache(config=loaded.model.config)
                if reused:
                    prefill(prompt[:reused], cache)
                started = time.perf_counter()
                prefill(prompt[reused:], cache)
                incremental.append(time.perf_counter() - started)
            rows.append({"raw_full_ms": 1000 * statistics.median(full),
                         "raw_incremental_ms": 1000 * statistics.median(incremental)})
            session.record_turn(content, reply)
            previous = renderer.render(session.messages_with_system(), add_generation_prompt=False)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", type=Path, default=HERE / "scenarios" / "internet_support.json")
    parser.add_argument("--repeats", type=int, default=3, help="conversations per server; medians are reported")
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "session_cache_ttft.json")
    args = parser.parse_args()
    scenario = json.loads(args.scenario.read_text())

    cached_server, uncached_server = ServerProcess(), ServerProcess("--no-session-cache")
    cached_url, uncached_url = cached_server.url, uncached_server.url
    try:
        passes = []
        for index in range(args.repeats):
            print(f"conversation {index + 1}/{args.repeats} ...", file=sys.stderr, flush=True)
            passes.append(asyncio.run(play(scenario, cached_url, uncached_url, args.max_new_tokens)))
    finally:
        for server in (cached_server, uncached_server):
            server.stop()

    print("raw model calls ...", file=sys.stderr, flush=True)
    raw = raw_prefill_times(scenario, [row["reply"] for row in passes[0]], args.repeats)
    rows = []
    for turn, raw_row in enumerate(raw):
        per_pass = [p[turn] for p in passes]
        row = {"turn": turn + 1, **{k: per_pass[0][k] for k in ("prompt_tokens", "cached_tokens", "source")},
               "same_reply": all(r["same_reply"] for r in per_pass),
               "ttft_cached_ms": statistics.median(r["ttft_cached_ms"] for r in per_pass),
               "ttft_uncached_ms": statistics.median(r["ttft_uncached_ms"] for r in per_pass), **raw_row}
        row["server_ratio"] = row["ttft_uncached_ms"] / row["ttft_cached_ms"]
        row["raw_ratio"] = row["raw_full_ms"] / row["raw_incremental_ms"]
        rows.append(row)

    header = (f"{'turn':>4} {'prompt':>6} {'cached':>6} {'ttft on':>8} {'ttft off':>8} {'ratio':>6} "
              f"{'raw inc':>8} {'raw full':>8} {'raw ratio':>9} {'same':>5}")
    print(header)
    for r in rows:
        print(f"{r['turn']:>4} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} {r['ttft_cached_ms']:>8.1f} "
              f"{r['ttft_uncached_ms']:>8.1f} {r['server_ratio']:>5.1f}x {r['raw_incremental_ms']:>8.1f} "
              f"{r['raw_full_ms']:>8.1f} {r['raw_ratio']:>8.1f}x {str(r['same_reply']):>5}")
    write_result(args.output, {"scenario": scenario["name"], "repeats": args.repeats,
                                       "max_new_tokens": args.max_new_tokens, "torch_threads": torch.get_num_threads(),
                                       "turns": rows})


if __name__ == "__main__":
    main()
