"""The engine's whole step, as turns meet it: this checkout against another (--a-checkout DIR, the commit before, in a
`git worktree`), each in fresh processes, alternating, so that this machine's drift falls on both alike. SmolLM2-135M
in float32, greedy, speculation off (its drafts follow measured step costs, which would make the two run different
passes): sixteen customers at once for three rounds (each later round's new message rides the others' decode steps),
and one customer alone for three turns. Reported: wall milliseconds per decode step over each case (its prefills,
sampling, stop checks and write-backs included: what the planner, the executor and the updater cost beside the model).
A checkout that publishes KV events (issue 52) is also measured with them on (`--kv-events-endpoint`, no subscriber:
the ledger, the queue and the sender thread all run), one engine after the other in the same process, in the order
off, on, on, off (each case's figure: the mean of its two), so that neither gains from going second.

    .venv/bin/python bench/engine_step.py --a-checkout /tmp/w/before [--pairs 6]
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from common import alternating_bench

HERE = Path(__file__).resolve()
QUESTIONS = ["My internet is down since this morning.", "How do I change the address on my bill?",
             "Can I pause my subscription for a month?", "Why was I charged twice in May?"]


def worker() -> dict:
    """Milliseconds per decode step over each case, in this process's checkout."""
    from chatd.config import Settings
    try:
        from chatd.engine.engine import Engine
    except ImportError:  # (a checkout from before the module was named for what it holds)
        from chatd.engine.scheduler import Engine
    from chatd.model.loader import load_model

    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    runs: list[tuple[str, dict]] = [("", {})]
    if "kv_events_endpoint" in Settings.model_fields:
        events = (", events on", {"kv_events_endpoint": "tcp://127.0.0.1:*"})
        runs = [runs[0], events, events, runs[0]]
    figures: dict[str, list[float]] = {}
    for index, (suffix, extra) in enumerate(runs):
        engine = Engine(lambda: loaded, Settings(max_batch=16, speculation="off", **extra))
        engine.start()
        engine.ready.wait()
        for case, ms in _measure(engine, f"{suffix}-{index}").items():
            figures.setdefault(f"{case}{suffix}", []).append(ms)
        engine.stop()
    return {case: round(sum(values) / len(values), 1) for case, values in figures.items()}


def _measure(engine, label: str) -> dict[str, float]:
    """Milliseconds per decode step of sixteen customers and of one, on `engine`."""
    ms_per_step(engine, "warm-up", 2)
    return {"sixteen customers": ms_per_step(engine, f"crowd{label}", 16),
            "one customer": ms_per_step(engine, f"one{label}", 1)}


def ms_per_step(engine, label: str, customers: int, rounds: int = 3, distinct: bool = False) -> float:
    """Milliseconds per decode step over `rounds` turns of `customers` new sessions at once (24 tokens each);
    `distinct`: each customer's messages name it, so that no two conversations hold the same tokens."""
    from sessions import Session

    system = "You are a helpful support agent. Be brief."
    sessions = [Session(f"{label}-{i}", system=system) for i in range(customers)]
    counts = getattr(engine, "counts", engine)  # (a checkout before the step's counts were their own value)
    steps_before = sum(counts.batch_sizes.values())
    started = time.perf_counter()
    for round_index in range(rounds):
        _round(engine, sessions, round_index, distinct)
    return round(1000 * (time.perf_counter() - started) / (sum(counts.batch_sizes.values()) - steps_before), 1)


def _round(engine, sessions: list, round_index: int, distinct: bool) -> None:
    """One turn of each session at once, 24 tokens each; recorded in its session."""
    from chatd.engine.sampling import SamplingParams
    from chatd.engine.turn import TokenText, Turn

    done, results = threading.Event(), {}

    def emitter(index: int):
        def emit(event) -> None:
            if not isinstance(event, TokenText):
                results[index] = event
                if len(results) == len(sessions):
                    done.set()
        return emit

    contents = [f"{QUESTIONS[i % len(QUESTIONS)]} (round {round_index}{f', {session.session_id}' if distinct else ''})"
                for i, session in enumerate(sessions)]
    for index, (session, content) in enumerate(zip(sessions, contents, strict=True)):
        engine.submit(Turn(turn_id=f"t{round_index}", session_id=session.session_id,
                           messages=session.prompt_messages(content),
                           params=SamplingParams(max_new_tokens=24), emit=emitter(index),
                           session_version=session.version))
    assert done.wait(600), "the engine did not finish the round"
    for index, (session, content) in enumerate(zip(sessions, contents, strict=True)):
        session.record_turn(content, results[index].content)


if __name__ == "__main__":
    alternating_bench(__doc__, HERE, worker, "engine_step.json")
