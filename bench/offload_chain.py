"""What an offload and a restore move at turn 2, 5 and 10 of a conversation (issue 33): one SmolLM2 session
through the ten turns of the internet-support scenario, offloaded to the host tier after every turn and
restored for the next; per turn the bytes the offload wrote and its time, the bytes the restore read and its
time. Run for this checkout and, with --a-checkout DIR, for another (the commit before, in a `git worktree`),
one after the other, alone on the machine.

    .venv/bin/python bench/offload_chain.py --a-checkout /tmp/w/old [--kv-dtype same int8] [--rounds 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from common import checkouts, in_checkout, write_result

HERE = Path(__file__).resolve()
TURNS = (2, 5, 10)


def worker(kv_dtype: str) -> dict:
    """The measurement in this process (the checkout on PYTHONPATH)."""
    import time

    import torch

    from chatd.model.loader import load_model
    from sessions import Session
    from tests.support import run_turn, running_engine

    torch.manual_seed(0)
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    scenario = json.loads((HERE.parent / "scenarios" / "internet_support.json").read_text())
    copies: list[tuple[str, float]] = []
    report = {}
    with running_engine(loaded, host_kv_dtype=kv_dtype, verify_sample_rate=0.0) as engine:
        engine.call(lambda store: setattr(store, "on_copy", lambda direction, tier, seconds: copies.append(
            (direction, seconds)))).result()
        session = Session("customer", system=scenario["system"])
        for turn, content in enumerate(scenario["turns"], start=1):
            copies.clear()
            done, _ = run_turn(engine, session, content, max_new_tokens=32)
            restore = [seconds for direction, seconds in copies if direction == "restore"]
            read = report.get(turn - 1, {}).get("host_bytes_held", 0)

            def offload(store):
                started = time.perf_counter()
                store.evict_idle()
                entry = store.host.get("customer")
                return time.perf_counter() - started, entry.nbytes, sum(p.nbytes for p in _pieces(entry))

            offload_s, written, held = engine.call(offload).result()
            report[turn] = {"tokens": len(done.conversation_ids), "offload_bytes": written,
                            "offload_ms": round(offload_s * 1000, 2), "host_bytes_held": held,
                            "restore_bytes": read if turn > 1 else 0,
                            "restore_ms": round(statistics.fsum(restore) * 1000, 2) if restore else None}
    # A turn's restore is of the copy the turn before offloaded: report it with the turn that restores it.
    later = [report[turn] for turn in range(2, len(report) + 1)]
    means = {key: round(statistics.fmean(row[key] for row in later), 2)
             for key in ("offload_bytes", "offload_ms", "restore_ms")}
    return {**{str(turn): report[turn] for turn in TURNS}, "mean of turns 2-10": means}


def _pieces(entry) -> list:
    """A host entry's chain of copies (one, before chains existed)."""
    return entry.pieces() if hasattr(entry, "pieces") else [entry]


def rounds(compared: dict[str, Path], kv_dtype: str, count: int) -> dict:
    """Each checkout's first run in full, and the means of every round: on a machine whose speed drifts, a
    difference is believed only where it holds across rounds in which either checkout went first."""
    runs: dict[str, list[dict]] = {label: [] for label in compared}
    for index in range(count):
        order = list(compared.items())
        for label, checkout in order if index % 2 == 0 else reversed(order):
            runs[label].append(in_checkout(HERE, checkout, kv_dtype))
    return {label: {**results[0], "each round": [run["mean of turns 2-10"] for run in results]}
            for label, results in runs.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--kv-dtype", nargs="+", default=["same", "int8"], choices=["same", "int8"])
    parser.add_argument("--rounds", type=int, default=1,
                        help="measure each checkout this many times, alternating which goes first")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker)))
        return
    compared = checkouts(HERE, args.a_checkout)
    report = {kv_dtype: rounds(compared, kv_dtype, args.rounds) for kv_dtype in args.kv_dtype}
    print(json.dumps(report, indent=2))
    write_result(HERE.parent / "results" / "offload_chain.json", report)


if __name__ == "__main__":
    main()
