"""Helpers shared by the benchmark scripts (run them from the repository root)."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
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
