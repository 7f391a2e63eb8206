"""Cost of the metrics and the stats windows: per finished turn, per /metrics scrape, and per
/v1/stats snapshot (what the dashboard asks for every 3 s) with five minutes of heavy traffic in
its windows. Synthetic turns, timed with the same code the server runs; no model needed.

    .venv/bin/python bench/observability_cost.py [--turns-per-s 10] [--tokens 256]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path

from common import median_ms, write_result

from chatd.engine.turn import TurnResult
from chatd.observability.metrics import LiveState, Metrics
from chatd.observability.stats import KEEP_S, SNAPSHOT_MAX_AGE_S, StatsRecorder

HERE = Path(__file__).parent


def synthetic_turn(finished_at: float, tokens: int, rng: random.Random) -> TurnResult:
    """A turn that ended at `finished_at` after `tokens` tokens at about 45 ms each."""
    gaps = [rng.uniform(0.03, 0.06) for _ in range(tokens - 1)]
    times, at = [], finished_at - sum(gaps)
    for gap in [0.0, *gaps]:
        at += gap
        times.append(at)
    ttft = rng.uniform(0.05, 0.5)
    source = rng.choice(["device", "device", "device", "host", "prefix", "miss"])
    return TurnResult(
        finish_reason="stop", content="", prompt_tokens=600, completion_tokens=tokens,
        cached_tokens=0 if source == "miss" else 560, cache_source=source,
        miss_reason="new" if source == "miss" else None, token_ids=[], token_times=times,
        timings={"queue_ms": 1.0, "ttft_ms": ttft * 1000, "prefill_ms": ttft * 1000 - 1,
                 "decode_ms": (times[-1] - times[0]) * 1000, "total_ms": (ttft + times[-1] - times[0]) * 1000,
                 "tokens_per_s": 22.0})


def fresh_snapshot(stats: StatsRecorder, live: LiveState, clock: list[float]) -> dict:
    """A snapshot computed anew (not the one shared by polls within SNAPSHOT_MAX_AGE_S)."""
    clock[0] += SNAPSHOT_MAX_AGE_S
    return stats.snapshot(live)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns-per-s", type=float, default=10.0, help="finished turns per second to simulate")
    parser.add_argument("--tokens", type=int, default=256, help="reply tokens per turn")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "observability_cost.json")
    args = parser.parse_args()
    rng = random.Random(0)
    now = time.perf_counter()
    clock = [now - KEEP_S]
    stats = StatsRecorder("bench", clock=lambda: clock[0])
    metrics = Metrics("bench")
    live = LiveState(running=16, waiting=2, connected_sessions=100,
                     cache={"device_bytes": 1 << 30, "device_budget_bytes": 2 << 30, "host_bytes": 1 << 30,
                            "host_budget_bytes": 4 << 30, "device_sessions": 40, "host_sessions": 60})
    turns = int(args.turns_per_s * KEEP_S)
    record_s, observe_s = [], []
    for index in range(turns):
        clock[0] = now - KEEP_S + index / args.turns_per_s
        turn = synthetic_turn(clock[0], args.tokens, rng)
        started = time.perf_counter()
        metrics.observe_turn(turn)
        observe_s.append(time.perf_counter() - started)
        started = time.perf_counter()
        stats.record_turn(turn)
        record_s.append(time.perf_counter() - started)
        if index % int(args.turns_per_s * 5) == 0:
            stats.sample(live)
    clock[0] = now
    result = {
        "turns_in_windows": turns, "tokens_per_turn": args.tokens,
        "observe_turn_ms": round(1000 * statistics.median(observe_s), 3),
        "record_turn_ms": round(1000 * statistics.median(record_s), 3),
        "metrics_scrape_ms": round(median_ms(lambda: metrics.exposition(live), 20), 2),
        "stats_snapshot_ms": round(median_ms(lambda: fresh_snapshot(stats, live, clock), 5), 1),
    }
    print(f"{turns} turns of {args.tokens} tokens in the last {KEEP_S:.0f} s "
          f"({args.turns_per_s:g} turns/s, {args.turns_per_s * args.tokens:,.0f} tokens/s):")
    print(f"  per finished turn: metrics {result['observe_turn_ms']} ms, stats {result['record_turn_ms']} ms")
    print(f"  /metrics scrape: {result['metrics_scrape_ms']} ms")
    print(f"  /v1/stats snapshot: {result['stats_snapshot_ms']} ms (at most one per {SNAPSHOT_MAX_AGE_S:g} s, "
          "shared by every poll)")
    write_result(args.output, result)


if __name__ == "__main__":
    main()
