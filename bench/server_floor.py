"""Through the server: many sessions with long histories asking at once, against the raw floor of
the same work.

A `chatd serve --max-batch N` process gets N sessions whose first turn leaves a cache of about
--history-tokens tokens; then all N send a new message at the same moment, and the wall time runs
from the first send to the last reply. The raw floor of that work is computed afterwards in this
process, with the server stopped: the prefill of each new message on top of a cache as long as its
history, plus one empty-cache forward step for every decode step the server ran, at the batch size
it ran it at (from `chatd:decode_steps_total`).

    .venv/bin/python bench/server_floor.py [--sessions 16] [--history-tokens 470] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import urllib.request
from collections import Counter
from pathlib import Path

import torch
from common import median_ms, write_result
from prometheus_client.parser import text_string_to_metric_families
from transformers import DynamicCache

from chatd.api.websocket.protocol import ChatDone
from chatd.cli.client import ChatClient
from chatd.cli.server_process import ServerProcess
from chatd.model.loader import load_model

HERE = Path(__file__).parent
QUESTION = "Any news on my case? Please tell me what happens next."


def decode_steps(url: str) -> Counter[int]:
    """The server's decode steps so far, by batch size."""
    metrics_url = url.replace("ws://", "http://").removesuffix("/ws") + "/metrics"
    with urllib.request.urlopen(metrics_url, timeout=30) as response:
        text = response.read().decode()
    return Counter({int(sample.labels["batch_size"]): int(sample.value)
                    for family in text_string_to_metric_families(text) for sample in family.samples
                    if sample.name == "chatd:decode_steps_total"})


def long_first_message(scenario: dict, words: int) -> str:
    """The scenario's customer lines, repeated to about `words` words: one long opening message."""
    lines, text = scenario["turns"], []
    while sum(len(line.split()) for line in text) < words:
        text.append(lines[len(text) % len(lines)])
    return " ".join(text)


async def run_round(url: str, scenario: dict, sessions: int, history_words: int, max_new_tokens: int
                    ) -> tuple[float, list[ChatDone], Counter[int]]:
    """Build the histories, then time every session asking at once."""
    async with await ChatClient.connect(url) as client:
        ids = [(await client.open_session(system=scenario["system"])).session_id for _ in range(sessions)]
        opening = long_first_message(scenario, history_words)
        await asyncio.gather(*[(await client.chat(i, opening, max_new_tokens=8)).result() for i in ids])
        before = await asyncio.to_thread(decode_steps, url)
        started = time.perf_counter()
        turns = [await client.chat(i, QUESTION, max_new_tokens=max_new_tokens) for i in ids]
        results = await asyncio.gather(*[turn.result() for turn in turns])
        wall_s = time.perf_counter() - started
        steps = await asyncio.to_thread(decode_steps, url)
    steps.subtract(before)
    return wall_s, list(results), +steps


def raw_floor_s(results: list[ChatDone], steps: Counter[int], repeats: int) -> tuple[float, float]:
    """(prefill seconds, decode seconds) of the same work as plain model calls."""
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    model, config = loaded.model, loaded.model.config

    def forward(ids: torch.Tensor, cache: DynamicCache) -> None:
        model(input_ids=ids, cache=cache, use_cache=True, logits_to_keep=1)

    prefill_ms = 0.0
    with torch.inference_mode():
        for result in results:
            cached, new = result.usage.cached_tokens, result.usage.prompt_tokens - result.usage.cached_tokens
            history = DynamicCache(config=config)
            forward(torch.randint(100, 1000, (1, cached)), history)
            new_ids = torch.randint(100, 1000, (1, new))

            def prefill(history=history, new_ids=new_ids, new=new) -> None:
                forward(new_ids, history)
                history.crop(-new)  # back to the history alone, for the next repeat

            prefill_ms += median_ms(prefill, repeats)
        decode_ms = sum(count * median_ms(lambda batch=batch: forward(
            torch.randint(100, 1000, (batch, 1)), DynamicCache(config=config)), repeats)
                        for batch, count in steps.items())
    return prefill_ms / 1000, decode_ms / 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=16)
    parser.add_argument("--history-tokens", type=int, default=470)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--flags", default="", help="more `chatd serve` flags")
    parser.add_argument("--repeats", type=int, default=5, help="timings per raw forward pass; medians are used")
    parser.add_argument("--scenario", type=Path, default=HERE / "scenarios" / "internet_support.json")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "server_floor.json")
    args = parser.parse_args()
    scenario = json.loads(args.scenario.read_text())

    server = ServerProcess(f"--max-batch {args.sessions} {args.flags}")
    try:
        # About 0.67 words per history token in these lines (the system prompt and the template included).
        wall_s, results, steps = asyncio.run(run_round(server.url, scenario, args.sessions,
                                                        int(args.history_tokens * 0.67), args.max_new_tokens))
    finally:
        server.stop()
    prefill_s, decode_s = raw_floor_s(results, steps, args.repeats)
    floor_s = prefill_s + decode_s
    histories = [result.usage.cached_tokens for result in results]
    generated = sum(result.usage.completion_tokens for result in results)
    print(f"{args.sessions} sessions, histories of {min(histories)}-{max(histories)} cached tokens, "
          f"{generated} tokens generated")
    print(f"decode steps by batch size: {dict(sorted(steps.items()))}")
    print(f"through the server: {wall_s:.2f} s; raw floor {floor_s:.2f} s (prefill {prefill_s:.2f} s, decode "
          f"{decode_s:.2f} s): {floor_s / wall_s:.2f} of the floor")
    write_result(args.output, {
        "sessions": args.sessions, "cached_tokens": histories, "generated_tokens": generated,
        "sources": [result.cache.source for result in results], "decode_steps": dict(steps),
        "wall_s": wall_s, "floor_prefill_s": prefill_s, "floor_decode_s": decode_s, "of_floor": floor_s / wall_s,
        "torch_threads": torch.get_num_threads(), "flags": args.flags})


if __name__ == "__main__":
    main()
