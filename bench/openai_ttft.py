"""A stateless 8-turn conversation through the official `openai` client: time to first token per
turn on chatd against the same server with --no-session-cache.

Starts both servers, plays the scenario's turns on both (alternating turn by turn, greedy), resending
the whole history each turn as OpenAI clients do, and reports each turn's TTFT (measured at the client,
from the request to the first content chunk) with the cached tokens the server reported.

    .venv/bin/python bench/openai_ttft.py [--turns 8] [--max-new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import openai
from common import write_result

from chatd.cli.bench import openai_url, served_model
from chatd.cli.server_process import ServerProcess

HERE = Path(__file__).parent


def turn(client: openai.OpenAI, model: str, messages: list[dict], max_new_tokens: int) -> tuple[float, str, int, int]:
    """(TTFT in ms, the reply, prompt tokens, cached tokens) of one streamed completion."""
    started, first, pieces, usage = time.perf_counter(), None, [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, max_tokens=max_new_tokens,
                                                temperature=0, stream=True, stream_options={"include_usage": True}):
        if chunk.choices and chunk.choices[0].delta.content:
            first = first or time.perf_counter()
            pieces.append(chunk.choices[0].delta.content)
        if chunk.usage is not None:
            usage = chunk.usage
    return 1000 * (first - started), "".join(pieces), usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", type=Path, default=HERE / "scenarios" / "internet_support.json")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="conversations per server; medians are reported")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "openai_ttft.json")
    args = parser.parse_args()
    scenario = json.loads(args.scenario.read_text())
    contents = [scenario["turns"][i % len(scenario["turns"])] for i in range(args.turns)]

    servers = {"cached": ServerProcess(""), "uncached": ServerProcess("--no-session-cache")}
    try:
        clients = {name: openai.OpenAI(base_url=openai_url(server.url), api_key="unused", max_retries=0)
                   for name, server in servers.items()}
        model = served_model(openai_url(servers["cached"].url), None)
        rows: list[list[dict]] = [[] for _ in contents]
        for _ in range(args.repeats):
            histories = {name: [{"role": "system", "content": scenario["system"]}] for name in servers}
            for index, content in enumerate(contents):
                row = {}
                for name, client in clients.items():
                    histories[name].append({"role": "user", "content": content})
                    ttft_ms, reply, prompt, cached = turn(client, model, histories[name], args.max_new_tokens)
                    histories[name].append({"role": "assistant", "content": reply})
                    row.update({f"{name}_ttft_ms": ttft_ms, f"{name}_reply": reply, "prompt_tokens": prompt,
                                f"{name}_cached_tokens": cached})
                rows[index].append(row)
    finally:
        for server in servers.values():
            server.stop()

    table = []
    print(f"{'turn':>4} {'prompt':>6} {'cached':>6} {'ttft cached':>11} {'ttft uncached':>13} {'ratio':>6} {'same':>5}")
    for index, runs in enumerate(rows):
        cached = statistics.median(r["cached_ttft_ms"] for r in runs)
        uncached = statistics.median(r["uncached_ttft_ms"] for r in runs)
        same = all(r["cached_reply"] == r["uncached_reply"] for r in runs)
        table.append({"turn": index + 1, "prompt_tokens": runs[0]["prompt_tokens"],
                      "cached_tokens": runs[0]["cached_cached_tokens"], "ttft_cached_ms": cached,
                      "ttft_uncached_ms": uncached, "ratio": uncached / cached, "same_reply": same})
        print(f"{index + 1:>4} {runs[0]['prompt_tokens']:>6} {runs[0]['cached_cached_tokens']:>6} {cached:>11.1f} "
              f"{uncached:>13.1f} {uncached / cached:>5.1f}x {str(same):>5}")
    late = [row for row in table if row["turn"] >= 5]
    if late:
        ratio = sum(r["ttft_uncached_ms"] for r in late) / sum(r["ttft_cached_ms"] for r in late)
        print(f"turns 5-{len(table)}: TTFT {ratio:.1f}x lower with the session cache")
    write_result(args.output, {"scenario": scenario["name"], "repeats": args.repeats, "turns": table})


if __name__ == "__main__":
    main()
