"""A stateless 8-turn conversation through the official `anthropic` SDK (`/v1/messages`, streamed): time to
first token per turn on chatd against the same server with --no-session-cache.

Starts both servers, plays the scenario's turns on both (alternating turn by turn, greedy), resending the whole
history each turn as Anthropic's clients do, and reports each turn's TTFT (measured at the client, from the
request to the first text delta) with the prompt tokens the server reported read from its cache.

    .venv/bin/python bench/anthropic_ttft.py [--turns 8] [--max-new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import time

import anthropic
from common import alternate_conversations, cached_and_uncached, report_ttft, ttft_arguments


def turn(client: anthropic.Anthropic, model: str, system: str, messages: list[dict], max_new_tokens: int
         ) -> tuple[float, str, int, int]:
    """(TTFT in ms, the reply, prompt tokens, prompt tokens read from the cache) of one streamed message."""
    started, first, pieces = time.perf_counter(), None, []
    with client.messages.stream(model=model, system=system, messages=messages, max_tokens=max_new_tokens,
                                extra_body={"temperature": 0}) as stream:
        for text in stream.text_stream:
            first = first or time.perf_counter()
            pieces.append(text)
        usage = stream.get_final_message().usage
    prompt = usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens
    return 1000 * ((first or time.perf_counter()) - started), "".join(pieces), prompt, usage.cache_read_input_tokens


def main() -> None:
    args, scenario, contents = ttft_arguments(__doc__, "anthropic_ttft.json")
    with cached_and_uncached() as (urls, model):
        clients = {name: anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
                   for name, url in urls.items()}
        rows = alternate_conversations(clients, contents, [], args.repeats, lambda client, history: turn(
            client, model, scenario["system"], history, args.max_new_tokens))
    report_ttft(rows, scenario["name"], args.repeats, args.output)


if __name__ == "__main__":
    main()
