"""KV events (issue 52): what publishing costs the decode step, and whether a real router's view stays exact.

`--part cost`: one engine (SmolLM2-135M, float32, greedy, speculation off, `--kv-events-endpoint` on, no
subscriber), its events switched off and on between cases in the order off, on, on, off, repeated (`--repeats`), so
that drift falls on both alike and no process-to-process spread enters the comparison: wall milliseconds per decode
step of sixteen customers (three rounds, 24 tokens each, every conversation its own tokens, so that each turn
publishes new blocks) and of one, each case's mean over its runs, the paired ratio,
and an upper bound of what events can cost the step: the engine thread's own time in the ledger and the queue (timed
around each call) plus the sender thread's CPU time (all of it, as if it only ever took the engine's turn), against
the wall time of the cases run with events on.

`--part churn`: NVIDIA Dynamo's standalone KV indexer (`.venv/dynamo`, as `make test` installs it) subscribed to two
`chatd serve` workers with small device and host budgets; `--turns` turns per worker, five conversations at a time
(continued, begun anew, one salted); then, per worker and medium, the blocks in the indexer's `/dump` against the
blocks the worker's tiers hold (`GET /kv/blocks`).

    .venv/bin/python bench/kv_events.py --part cost [--repeats 2]
    .venv/bin/python bench/kv_events.py --part churn [--turns 150]
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
from common import write_result
from engine_step import ms_per_step

ROOT = Path(__file__).resolve().parent.parent
MODEL = "smollm2-135m"


# ##### What publishing costs the step #####

class Stopwatch:
    """Seconds spent inside the wrapped calls (the engine thread's time in events)."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, owner: object, name: str) -> None:
        call = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started

        setattr(owner, name, timed)


def cost(repeats: int) -> dict:
    from cache_store.tier_events import NO_EVENTS
    from chatd.config import Settings
    from chatd.engine.engine import Engine
    from chatd.model.loader import load_model

    loaded = load_model(MODEL, device="cpu", dtype="float32")
    engine = Engine(lambda: loaded, Settings(max_batch=16, speculation="off", kv_events_endpoint="tcp://127.0.0.1:*"))
    engine.start()
    engine.ready.wait()
    ledger, watch = engine.ledger, Stopwatch()
    for name in ("held", "let_go", "flush"):
        watch.wrap(ledger, name)

    def switch(on: bool) -> None:
        def apply(store) -> None:
            store.device.events = store.host.events = ledger if on else NO_EVENTS
            engine.ledger = ledger if on else None
        engine.call(apply).result()

    figures: dict[str, dict[str, list[float]]] = {"off": {}, "on": {}}
    on_seconds = 0.0
    try:
        ms_per_step(engine, "warm-up", 2, 1)
        for index, on in enumerate([False, True, True, False] * repeats):
            switch(on)
            started = time.perf_counter()
            for case, customers in (("sixteen customers", 16), ("one customer", 1)):
                figures["on" if on else "off"].setdefault(case, []).append(
                    ms_per_step(engine, f"{case}-{index}", customers, distinct=True))
            on_seconds += (time.perf_counter() - started) if on else 0.0
        batches = engine.kv_events.batches_sent
        sender_s = time.clock_gettime(time.pthread_getcpuclockid(engine.kv_events._thread.ident))
    finally:
        engine.stop()
    report = {}
    for case in figures["off"]:
        off, on = figures["off"][case], figures["on"][case]
        pairs = [b / a for a, b in zip(off, on, strict=True)]
        report[case] = {"off_ms": round(sum(off) / len(off), 1), "on_ms": round(sum(on) / len(on), 1),
                        "on_vs_off": round(sum(on) / sum(off) - 1, 4), "paired": [round(p - 1, 4) for p in pairs],
                        "off_runs": off, "on_runs": on}
    report["events"] = {"engine_thread_s": round(watch.seconds, 3), "sender_thread_cpu_s": round(sender_s, 3),
                        "events_on_wall_s": round(on_seconds, 1),
                        "share": round((watch.seconds + sender_s) / on_seconds, 5), "batches_sent": batches}
    return report


# ##### A churn through a real router #####

SYSTEMS = ["You are the support desk of a broadband company. Answer in one or two short sentences.",
           "You are a travel agent. Answer briefly.", "You answer questions about trains, briefly."]
DYNAMO_TIERS = {"device": "GPU", "host_pinned": "CPU"}


def churn(turns: int) -> dict:
    from chatd.cli.server_process import ServerProcess, free_port

    port = free_port()
    indexer = subprocess.Popen([str(ROOT / ".venv/dynamo/bin/python"), "-m", "dynamo.indexer", "--port", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    http = httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30)
    workers: list[tuple[ServerProcess, int, int]] = []
    try:
        for worker_id in (1, 2):
            events, replay = free_port(), free_port()
            server = ServerProcess(["--model", MODEL, "--device", "cpu", "--speculation", "off",
                                    "--device-cache-mb", "32", "--host-cache-mb", "64",
                                    "--kv-events-endpoint", f"tcp://*:{events}",
                                    "--kv-events-replay-endpoint", f"tcp://*:{replay}"])
            workers.append((server, events, replay))
            _wait_for(lambda: http.get("/workers").raise_for_status())
            http.post("/register", json={"instance_id": worker_id, "endpoint": f"tcp://127.0.0.1:{events}",
                                         "model_name": MODEL, "block_size": 16,
                                         "replay_endpoint": f"tcp://127.0.0.1:{replay}"}).raise_for_status()
        started = time.perf_counter()
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda worker, offset: _converse(worker[0].port, turns, offset), workers, (0, 5)))
        seconds = time.perf_counter() - started
        time.sleep(2)  # (the last batches reach the indexer)
        report = {"turns": 2 * turns, "seconds": round(seconds, 1)}
        dump = http.get("/dump").json()
        for worker_id, (server, _, _) in enumerate(workers, start=1):
            base = f"http://127.0.0.1:{server.port}"
            held = {medium: set(ids) for medium, ids in httpx.get(base + "/kv/blocks").json()["blocks"].items()}
            seen = _indexed(dump, worker_id)
            metrics = httpx.get(base + "/metrics").text
            report[f"worker {worker_id}"] = {
                **{f"{medium} blocks (worker / indexer)": f"{len(held[medium])} / {len(seen.get(medium, ()))}"
                   for medium in ("GPU", "CPU")},
                "equal": all(held[medium] == seen.get(medium, set()) for medium in ("GPU", "CPU")),
                "batches": {outcome: float(value) for outcome, value in re.findall(
                    r'^chatd:kv_event_batches_total\{[^}]*outcome="(\w+)"[^}]*\} (\S+)$', metrics, re.MULTILINE)},
                "evictions": _metric(metrics, "chatd:cache_evictions_total")}
        return report
    finally:
        for server, _, _ in workers:
            server.stop()
        http.close()
        indexer.terminate()
        indexer.wait(10)


def _converse(port: int, turns: int, offset: int) -> None:
    """Ten conversations, five at a time, continued until they are long, then begun anew; the tenth salted."""
    conversations: list[list[dict]] = [[{"role": "system", "content": SYSTEMS[i % 3]}] for i in range(10)]
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=600)

    def turn(index: int, number: int) -> None:
        messages = conversations[index]
        messages.append({"role": "user", "content": f"Question {number}: what about item {number * 13 % 97}?"})
        body = {"model": MODEL, "messages": messages, "max_tokens": 8, "temperature": 0,
                **({"cache_salt": "tenant-3"} if index == 9 else {})}
        answer = client.post("/chat/completions", json=body)
        answer.raise_for_status()
        messages.append({"role": "assistant", "content": answer.json()["choices"][0]["message"]["content"]})
        if len(messages) > 13:
            conversations[index] = messages[:1]

    with ThreadPoolExecutor(5) as pool:
        for round_index in range(turns // 5):
            picked = [(round_index * 3 + offset + step * 2) % 10 for step in range(5)]
            list(pool.map(turn, picked, [round_index * 5 + step for step in range(5)]))
    client.close()


def _indexed(dump: dict, worker_id: int) -> dict[str, set[int]]:
    """The blocks the indexer holds for `worker_id`, per medium, over every model and scope."""
    seen: dict[str, set[int]] = {}
    for scope in dump.values():
        for event in scope["events"]:
            if event["worker_id"] == worker_id:
                medium = DYNAMO_TIERS.get(event["storage_tier"], event["storage_tier"])
                blocks = event["event"]["data"]["stored"]["blocks"]
                seen.setdefault(medium, set()).update(block["block_hash"] for block in blocks)
    return seen


def _metric(text: str, name: str) -> float:
    return sum(float(value) for value in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.MULTILINE))


def _wait_for(check, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            check()
            return
        except httpx.HTTPError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=["cost", "churn"], required=True)
    parser.add_argument("--repeats", type=int, default=2, help="(cost) times the order off, on, on, off runs")
    parser.add_argument("--turns", type=int, default=150, help="(churn) turns per worker")
    args = parser.parse_args()
    result = cost(args.repeats) if args.part == "cost" else churn(args.turns)
    print(json.dumps(result, indent=2))
    write_result(ROOT / "bench" / "results" / f"kv_events_{args.part}.json", result)
