"""A stateless 8-turn conversation through the official `openai` client: time to first token per
turn on chatd against the same server with --no-session-cache.

Starts both servers, plays the scenario's turns on both (alternating turn by turn, greedy), resending
the whole history each turn as OpenAI clients do, and reports each turn's TTFT (measured at the client,
from the request to the first content chunk) with the cached tokens the server reported.

    .venv/bin/python bench/openai_ttft.py [--turns 8] [--max-new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import time

import openai
from common import alternate_conversations, cached_and_uncached, report_ttft, ttft_arguments


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
    args, scenario, contents = ttft_arguments(__doc__, "openai_ttft.json")
    with cached_and_uncached() as (urls, model):
        clients = {name: openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)
                   for name, url in urls.items()}
        first = [{"role": "system", "content": scenario["system"]}]
        rows = alternate_conversations(clients, contents, first, args.repeats,
                                       lambda client, history: turn(client, model, history, args.max_new_tokens))
    report_ttft(rows, scenario["name"], args.repeats, args.output)


if __name__ == "__main__":
    main()
