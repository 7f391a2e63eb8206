"""The batched decode step itself, one token a row: this checkout (rows packed into one sequence, issue 41) against
another (--a-checkout DIR, the commit before, in a `git worktree`), each in fresh processes, alternating, so that
this machine's drift falls on both alike. SmolLM2-135M in float32, 16 rows on 100-token caches, and one row alone.

    .venv/bin/python bench/packed_step.py --a-checkout /tmp/w/before [--pairs 6]
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

from common import alternating_bench

HERE = Path(__file__).resolve()


def worker() -> dict:
    """Median milliseconds of a decode step at batch 16 and at batch 1, in this process's checkout."""
    import torch

    from cache_store import CacheEntry
    from chatd.config import Settings
    try:
        from chatd.engine.engine import Engine
    except ImportError:  # (a checkout from before the module was named for what it holds)
        from chatd.engine.scheduler import Engine
    from chatd.model.loader import load_model

    # Before issue 41 a step took one token per row; since, a list of tokens per row.
    rows_of_any_length = "speculation" in Settings.model_fields
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    engine = Engine(lambda: loaded, Settings(max_batch=16))
    engine.start()
    engine.ready.wait()
    figures = {}
    with torch.inference_mode():
        for batch, tokens in ((16, 100), (1, 100)):
            entries = []
            for _ in range(batch):
                entry = CacheEntry(engine.runner.new_cache())
                engine.runner.forward(entry, torch.randint(100, 1000, (tokens,)).tolist())
                entry.cache.reserve(tokens + 40)
                entries.append(entry)
            nexts = torch.randint(100, 1000, (batch,)).tolist()
            inputs = [[token] for token in nexts] if rows_of_any_length else nexts
            samples = []
            for step in range(23):
                started = time.perf_counter()
                engine.runner.decode(entries, inputs)
                if step >= 3:  # three warm-up steps
                    samples.append(time.perf_counter() - started)
            figures[f"batch {batch}"] = round(1000 * statistics.median(samples), 1)
    engine.stop()
    return figures


if __name__ == "__main__":
    alternating_bench(__doc__, HERE, worker, "packed_step.json")
