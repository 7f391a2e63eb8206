"""How much of each prompt a cache covers for stateless OpenAI clients behind nginx, with 2 and 3 workers.

For each worker count: a fresh redis-server, that many `chatd serve --redis-url … --remote-kv` workers,
and nginx with the shipped configuration (deploy/nginx/chatd.conf: requests that name no session are
balanced by load over every worker). Then `chatd bench`'s stateless OpenAI customers (the whole history
every turn, no session hints) play the bench scenarios through nginx, and the share of their prompt tokens
that came from a cache is reported for turns 3 and later, with TTFT. Run it alone on the machine.

    .venv/bin/python bench/routing_hits.py [--workers 1 2 3] [--customers 6] [--turns 8] [--model smollm2-135m]
        [--checkout DIR]    (the workers run that checkout's code: a worktree of the commit before a change)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from common import write_result

from chatd.cli.bench import DEFAULT_SCENARIOS, Workload, load_scenarios, run_workload, summarize
from chatd.cli.nginx_process import NginxProcess
from chatd.cli.server_process import ServerProcess, free_port

HERE = Path(__file__).parent


def start_redis(folder: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    process = subprocess.Popen([shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind",
                                "127.0.0.1", "--dir", str(folder), "--save", "", "--appendonly", "no"],
                               stdout=subprocess.DEVNULL)
    time.sleep(0.5)
    return process, f"redis://127.0.0.1:{port}/0"


def measure(count: int, model: str, workload: Workload, checkout: Path | None) -> dict:
    with tempfile.TemporaryDirectory() as folder:
        redis_process, redis_url = start_redis(Path(folder))
        threads = max(1, len(os.sched_getaffinity(0)) // count)  # workers on one machine share its cores
        with ThreadPoolExecutor(count) as pool:
            workers = list(pool.map(lambda _: ServerProcess(["--model", model, "--redis-url", redis_url, "--remote-kv",
                                                             "--max-batch", "16", "--threads", str(threads)],
                                                            checkout), range(count)))
        nginx = NginxProcess(workers, Path(folder))
        try:
            samples, wall_s = asyncio.run(run_workload(f"{nginx.http_url}/v1", workload, f"{count} workers"))
        finally:
            nginx.stop()
            for worker in workers:
                worker.stop()
            redis_process.terminate()
            redis_process.wait(10)
    summary = summarize(samples, wall_s)
    late = [s for s in samples if s.turn >= 3 and s.prompt_tokens]
    worst = min((s.cached_tokens / s.prompt_tokens for s in late), default=None)
    return {"workers": count, "cached_percent_turn3_plus": summary["cached_percent_turn3_plus"],
            "worst_turn_percent": 100 * worst if worst is not None else None,
            "ttft_ms_turn3_plus": summary["ttft_ms_turn3_plus"], "errors": summary["errors"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--customers", type=int, default=6)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--checkout", type=Path, help="serve with the code of this checkout")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "routing_hits.json")
    args = parser.parse_args()
    workload = Workload(load_scenarios(DEFAULT_SCENARIOS), args.customers, args.turns, 0.5, args.max_new_tokens, 0)
    rows = []
    for count in args.workers:
        rows.append(measure(count, args.model, workload, args.checkout))
        row = rows[-1]
        print(f"{count} workers: {row['cached_percent_turn3_plus']:.1f}% of the prompt tokens of turns 3+ from a "
              f"cache (the worst turn {row['worst_turn_percent']:.1f}%); TTFT p50/p95 "
              f"{row['ttft_ms_turn3_plus']['p50']:.0f}/{row['ttft_ms_turn3_plus']['p95']:.0f} ms; errors "
              f"{row['errors'] or 'none'}", flush=True)
    write_result(args.output, {"customers": args.customers, "turns": args.turns, "rows": rows})


if __name__ == "__main__":
    main()
