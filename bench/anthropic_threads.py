"""An 8-turn conversation through the official `anthropic` SDK (`/v1/messages`, streamed), threaded against
unthreaded: time to first token per turn when each request sends only the new message (`thread` continue) and when
it resends the whole history (chatd then matches it to its session), each on a `chatd serve` of its own with the
session cache, alternating turn by turn, greedy. Both read the history from the cache; the threaded request skips
sending, parsing, rendering and matching it.

    .venv/bin/python bench/anthropic_threads.py [--turns 8] [--max-new-tokens 32] [--repeats 2]
"""

from __future__ import annotations

import statistics
import time

import anthropic
from common import ttft_arguments, write_result

from chatd.cli.bench import openai_url, served_model
from chatd.cli.server_process import ServerProcess

BETA = "message-threads-2026-08-12"


def turn(client: anthropic.Anthropic, model: str, system: str, messages: list[dict], max_new_tokens: int,
         thread: dict | None) -> tuple[float, anthropic.types.beta.BetaMessage]:
    """(TTFT in ms, the final message) of one streamed message."""
    started, first = time.perf_counter(), None
    fields = {"thread": thread, "betas": [BETA]} if thread is not None else {}
    if thread is None or thread["type"] == "create":
        fields["system"] = system
    with client.beta.messages.stream(model=model, messages=messages, max_tokens=max_new_tokens,
                                     extra_body={"temperature": 0}, **fields) as stream:
        for _ in stream.text_stream:
            first = first or time.perf_counter()
        message = stream.get_final_message()
    return 1000 * ((first or time.perf_counter()) - started), message


def main() -> None:
    args, scenario, contents = ttft_arguments(__doc__, "anthropic_threads.json")
    servers = {"threaded": ServerProcess(""), "whole": ServerProcess("")}
    try:
        urls = {name: openai_url(server.url).removesuffix("/v1") for name, server in servers.items()}
        model = served_model(urls["threaded"] + "/v1", None)
        clients = {name: anthropic.Anthropic(base_url=url, api_key="unused", max_retries=0)
                   for name, url in urls.items()}
        rows: list[list[dict]] = [[] for _ in contents]
        for _ in range(args.repeats):
            history, previous = [], None
            for index, content in enumerate(contents):
                asked = {"role": "user", "content": content}
                thread = {"type": "continue", "previous_message_id": previous.id} if previous else {"type": "create"}
                threaded_ms, previous = turn(clients["threaded"], model, scenario["system"], [asked],
                                             args.max_new_tokens, thread)
                whole_ms, whole = turn(clients["whole"], model, scenario["system"], [*history, asked],
                                       args.max_new_tokens, None)
                history += [asked, {"role": "assistant", "content": [b.model_dump() for b in whole.content]}]
                usage = previous.usage
                rows[index].append({"threaded_ms": threaded_ms, "whole_ms": whole_ms,
                                    "prompt_tokens": usage.input_tokens + usage.cache_read_input_tokens
                                    + usage.cache_creation_input_tokens, "read": usage.cache_read_input_tokens,
                                    "same": [b.model_dump() for b in previous.content]
                                    == [b.model_dump() for b in whole.content]})
    finally:
        for server in servers.values():
            server.stop()
    table = []
    print(f"{'turn':>4} {'prompt':>6} {'read':>6} {'ttft threaded':>13} {'ttft whole':>10} {'ratio':>6} {'same':>5}")
    for index, runs in enumerate(rows):
        threaded, whole = (statistics.median(r[key] for r in runs) for key in ("threaded_ms", "whole_ms"))
        same = all(r["same"] for r in runs)
        table.append({"turn": index + 1, "prompt_tokens": runs[0]["prompt_tokens"], "read": runs[0]["read"],
                      "ttft_threaded_ms": threaded, "ttft_whole_ms": whole, "same_reply": same})
        print(f"{index + 1:>4} {runs[0]['prompt_tokens']:>6} {runs[0]['read']:>6} {threaded:>13.1f} {whole:>10.1f} "
              f"{whole / threaded:>5.2f}x {str(same):>5}")
    late = [row for row in table if row["turn"] >= 5]
    if late:
        ratio = sum(r["ttft_whole_ms"] for r in late) / sum(r["ttft_threaded_ms"] for r in late)
        print(f"turns 5-{len(table)}: TTFT {ratio:.2f}x lower threaded than resending the history")
    write_result(args.output, {"scenario": scenario["name"], "repeats": args.repeats, "turns": table})


if __name__ == "__main__":
    main()
