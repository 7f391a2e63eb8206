"""What drafting adds to a long turn's first decode steps: the n-gram index over its prompt (a 32K-token prompt by
default) and a draft's lookup, as the engine thread pays them at each step, and the memory the index then takes.
The engine's step calls `Speculator.propose` for every row; before the index was built in pieces, a turn's first
step indexed its whole prompt while the batch waited. With --a-checkout the commit before is measured too, each in
a fresh process.

    .venv/bin/python bench/draft_index.py [--tokens 32768] [--turns 5] [--a-checkout /tmp/w/old]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
import tracemalloc
from pathlib import Path

from common import checkouts, in_checkout, write_result

HERE = Path(__file__).parent
STEPS = 4


def worker(tokens: int, turns: int) -> dict:
    """Per step of a new turn (the first `STEPS`), the milliseconds drafting took (median over `turns` turns)."""
    from chatd.engine.drafts import Speculator

    speculator = Speculator(6)
    rng = random.Random(0)
    steps: list[list[float]] = [[] for _ in range(STEPS)]
    for _ in range(turns):
        prompt = [rng.randrange(100, 49_000) for _ in range(tokens)]
        generated: list[int] = []
        row = None
        for step in range(STEPS):
            started = time.perf_counter()
            if hasattr(speculator, "new_step"):
                speculator.new_step()
            if row is None:
                row = speculator.start(prompt)
            speculator.propose(row, "owner", generated, room=64)
            steps[step].append(1000 * (time.perf_counter() - started))
            generated.append(rng.randrange(100, 49_000))
    tracemalloc.start()
    row = speculator.start(prompt)
    while getattr(row.index, "unindexed", 0):  # (the new index: built to its bound, step by step)
        speculator.new_step()
        speculator.propose(row, "owner", generated, room=64)
    index_mb = tracemalloc.get_traced_memory()[0] / 2**20
    tracemalloc.stop()
    return {"step_ms": [round(statistics.median(times), 3) for times in steps], "index_mb": round(index_mb, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--a-checkout", type=Path, help="another checkout (the commit before) to compare with")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.tokens, args.turns)))
        return
    results = {name: in_checkout(Path(__file__), checkout, "--tokens", str(args.tokens), "--turns", str(args.turns))
               for name, checkout in checkouts(Path(__file__), args.a_checkout).items()}
    for name, result in results.items():
        steps = ", ".join(f"{ms:.2f}" for ms in result["step_ms"])
        print(f"{name:>6}: drafting in the first {STEPS} steps of a {args.tokens}-token turn: {steps} ms; "
              f"index {result['index_mb']} MB", file=sys.stderr)
    write_result(HERE / "results" / "draft_index.json", {"tokens": args.tokens, **results})


if __name__ == "__main__":
    main()
