"""What the weights' digest in the model identity costs at start: hashing SmolLM2's converted checkpoint the first
time (xxh3-128 over every byte of its weight files), and every later start (the digest read back beside them, the
file unchanged); and a model's parameters hashed in memory (a model with no files).

    .venv/bin/python bench/weights_digest.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from common import write_result

from chatd.model.loader import converted_checkpoint, default_cache_dir, load_model
from chatd.model.weights_digest import parameters_digest, weight_files, weights_digest

HERE = Path(__file__).parent


def timed_ms(action, repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        action()
        samples.append(time.perf_counter() - started)
    return round(1000 * statistics.median(samples), 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    folder = converted_checkpoint("smollm2-135m", default_cache_dir())
    loaded = load_model("smollm2-135m", device="cpu", dtype="float32")
    nbytes = sum(path.stat().st_size for path in weight_files(folder))

    def first_time() -> None:
        with tempfile.TemporaryDirectory() as empty:  # no digest kept yet: every byte is hashed
            weights_digest(folder, loaded.model, Path(empty))

    with tempfile.TemporaryDirectory() as kept:
        weights_digest(folder, loaded.model, Path(kept))
        later = timed_ms(lambda: weights_digest(folder, loaded.model, Path(kept)), args.repeats)
    report = {"checkpoint_mb": round(nbytes / 2**20, 1), "first_start_ms": timed_ms(first_time, args.repeats),
              "later_starts_ms": later,
              "parameters_in_memory_ms": timed_ms(lambda: parameters_digest(loaded.model), args.repeats)}
    print(json.dumps(report, indent=2))
    write_result(HERE / "results" / "weights_digest.json", report)


if __name__ == "__main__":
    main()
