"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from chatd.model.prompt import PromptRenderer
from sessions import Message

REPLY = ("Thank you, I have noted that. I checked your line and your account, and I can see the issue. "
         "Here is what we will do next, step by step, so that your service works again as soon as possible.")


def synthetic_history(scenario: dict, renderer: PromptRenderer, tokens: int) -> list[Message]:
    """Alternate the scenario's customer lines with a canned agent reply until `tokens` is reached."""
    messages: list[Message] = []
    system = [Message("system", scenario["system"])]
    while len(renderer.render(system + messages, add_generation_prompt=False)) < tokens:
        question = scenario["turns"][len(messages) // 2 % len(scenario["turns"])]
        messages += [Message("user", question), Message("assistant", REPLY)]
    return messages


def checkouts(script: Path, a_checkout: Path | None) -> dict[str, Path]:
    """The checkouts a comparison measures: this one (`after`), and with --a-checkout the other (`before`)."""
    return {"after": script.parent.parent, **({"before": a_checkout} if a_checkout else {})}


def in_checkout(script: Path, checkout: Path, *args: str) -> dict:
    """Run `script --worker ARGS` in a fresh process on `checkout`'s packages (this one, or the commit before in
    a `git worktree`) and return the JSON its last line printed."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    output = subprocess.run([sys.executable, str(script), "--worker", *args], cwd=checkout, env=env, check=True,
                            capture_output=True, text=True).stdout
    return json.loads(output.strip().splitlines()[-1])


def alternating_bench(doc: str, script: Path, worker: Callable[[], dict], result_name: str) -> None:
    """A benchmark's `main`: `worker` (which measures each case in its own process's checkout) in `--pairs` fresh
    processes per checkout (this one and, with `--a-checkout`, the commit before), alternating, so that this
    machine's drift falls on both alike; each case's median and every run, by checkout, printed and written."""
    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--pairs", type=int, default=6, help="fresh processes per checkout, alternating")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker()))
        return
    runs: dict[str, list[dict]] = {}
    for _ in range(args.pairs):
        for label, checkout in checkouts(script, args.a_checkout).items():
            runs.setdefault(label, []).append(in_checkout(script, checkout))
    report = {label: {case: {"step_ms": statistics.median(run[case] for run in label_runs),
                             "runs": [run[case] for run in label_runs]} for case in label_runs[0]}
              for label, label_runs in runs.items()}
    print(json.dumps(report, indent=2))
    write_result(script.parent / "results" / result_name, report)


def write_result(path: Path, result: object) -> None:
    """Write a benchmark's JSON result next to the others (bench/results/ is not committed)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}", file=sys.stderr)


def mean_ms(action: Callable[[], object], repeats: int, warm_up: int = 10) -> float:
    """The mean wall time of `action` over `repeats` calls after `warm_up` untimed ones, in milliseconds (for calls
    too short to time one by one)."""
    for _ in range(warm_up):
        action()
    started = time.perf_counter()
    for _ in range(repeats):
        action()
    return round((time.perf_counter() - started) / repeats * 1000, 3)


def median_ms(action: Callable[[], object], repeats: int) -> float:
    """The median wall time of `action`, in milliseconds."""
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return 1000 * statistics.median(samples)


# One turn of a client: (its history, with the new user message) -> (TTFT ms, the reply, prompt tokens, cached).
TtftTurn = Callable[[object, list[dict]], tuple[float, str, int, int]]


def alternate_conversations(clients: dict[str, object], contents: list[str], first: list[dict], repeats: int,
                            turn: TtftTurn) -> list[list[dict]]:
    """Play the same conversation on every client (`cached`, `uncached`), turn by turn alternating, `repeats` times,
    resending the whole history each turn as a stateless client does: per turn, one row per repeat."""
    rows: list[list[dict]] = [[] for _ in contents]
    for _ in range(repeats):
        histories = {name: list(first) for name in clients}
        for index, content in enumerate(contents):
            row = {}
            for name, client in clients.items():
                histories[name].append({"role": "user", "content": content})
                ttft_ms, reply, prompt, cached = turn(client, histories[name])
                histories[name].append({"role": "assistant", "content": reply})
                row.update({f"{name}_ttft_ms": ttft_ms, f"{name}_reply": reply, "prompt_tokens": prompt,
                            f"{name}_cached_tokens": cached})
            rows[index].append(row)
    return rows


def report_ttft(rows: list[list[dict]], scenario: str, repeats: int, output: Path) -> None:
    """Print each turn's median TTFT cached and uncached (and whether the replies were the same), and write them."""
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
    write_result(output, {"scenario": scenario, "repeats": repeats, "turns": table})


def ttft_arguments(doc: str, output: str) -> tuple[argparse.Namespace, dict, list[str]]:
    """The flags of a cached-against-uncached TTFT benchmark: (the flags, the scenario, the turns' messages)."""
    here = Path(__file__).parent
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--scenario", type=Path, default=here / "scenarios" / "internet_support.json")
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2, help="conversations per server; medians are reported")
    parser.add_argument("--output", type=Path, default=here / "results" / output)
    args = parser.parse_args()
    scenario = json.loads(args.scenario.read_text())
    return args, scenario, [scenario["turns"][i % len(scenario["turns"])] for i in range(args.turns)]


@contextlib.contextmanager
def cached_and_uncached() -> Iterator[tuple[dict[str, str], str]]:
    """Two `chatd serve` processes, with the session cache and with --no-session-cache: their HTTP base URLs (by
    name: `cached`, `uncached`) and the served model's name; both stopped at the end."""
    from chatd.cli.bench import openai_url, served_model
    from chatd.cli.server_process import ServerProcess

    servers = {"cached": ServerProcess(""), "uncached": ServerProcess("--no-session-cache")}
    try:
        urls = {name: openai_url(server.url).removesuffix("/v1") for name, server in servers.items()}
        yield urls, served_model(urls["cached"] + "/v1", None)
    finally:
        for server in servers.values():
            server.stop()
