"""Every device path of chatd, run once, with a table of what it measured. Made for a CUDA machine;
`--device cpu` runs the same code (pageable instead of pinned memory, no graphs) as a quick check, so
that the script cannot rot between the rare runs on a GPU.

    .venv/bin/python bench/gpu_check.py --device cuda
    .venv/bin/python bench/gpu_check.py --device cpu --model PATH --tokens 64 --batches 1 2
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cache_store import CacheEntry
from cache_store.host.host_pool import HostBufferPool
from cache_store.host.offload import Offloader, kv_nbytes
from cache_store.remote.remote_format import StoredKV
from cache_store.remote.remote_moves import pinned
from chatd.config import Settings
from chatd.engine.deep_check import deep_check_distance
from chatd.engine.engine import Engine
from chatd.model.loader import load_model

HERE = Path(__file__).parent


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def offload_and_restore(engine: Engine, tokens: int) -> list[tuple[str, str]]:
    """A cache of `tokens` tokens to (pinned) host memory and back: bytes equal, and the copy rates."""
    device = engine.loaded.device
    ids = torch.randint(100, 1000, (tokens,)).tolist()
    with torch.inference_mode():
        entry = CacheEntry(engine.runner.new_cache())
        engine.runner.forward(entry, ids)
    pool, offloader = HostBufferPool(pinned=device.type == "cuda"), Offloader(device)
    nbytes = kv_nbytes(entry)
    synchronize(device)
    started = time.perf_counter()
    host = offloader.offload(entry, pool.take(nbytes))
    offload_s = time.perf_counter() - started
    started = time.perf_counter()
    restored, _ = offloader.restore(host, engine.runner.new_cache)
    synchronize(device)
    restore_s = time.perf_counter() - started
    equal = all(torch.equal(a, b) for pair, again in zip(entry.tensors(), restored.tensors(), strict=True)
                for a, b in zip(pair, again, strict=True))
    pinned = host.buffer is not None and host.buffer.is_pinned()
    memory = "pinned" if pinned else "pageable"
    return [(f"offload and restore, {tokens} tokens ({nbytes / 2**20:.1f} MB, {memory})",
             f"bytes equal: {equal}; offload {nbytes / offload_s / 1e9:.2f} GB/s, "
             f"restore {nbytes / restore_s / 1e9:.2f} GB/s")]


def fetched_copy_to_device(engine: Engine, tokens: int) -> list[tuple[str, str]]:
    """A cache as a Redis fetch brings it (host bytes, pinned on the fetching thread on CUDA), copied into the device
    on the side stream: bytes equal, and the copy rate seen by the engine thread."""
    device = engine.loaded.device
    ids = torch.randint(100, 1000, (tokens,)).tolist()
    with torch.inference_mode():
        entry = CacheEntry(engine.runner.new_cache())
        engine.runner.forward(entry, ids)
    part = StoredKV([(k.cpu(), v.cpu()) for k, v in entry.tensors()], None, "")
    part = pinned(part) if device.type == "cuda" else part
    offloader, nbytes = Offloader(device), kv_nbytes(entry)
    synchronize(device)
    started = time.perf_counter()
    (tensors,) = offloader.to_device([(part.tensors, None)], engine.loaded.model.dtype)
    queued_s = time.perf_counter() - started
    synchronize(device)
    copied_s = time.perf_counter() - started
    equal = all(torch.equal(a, b) for pair, again in zip(entry.tensors(), tensors, strict=True)
                for a, b in zip(pair, again, strict=True))
    memory = "pinned" if part.tensors[0][0].is_pinned() else "pageable"
    return [(f"a fetched Redis copy to the device, {tokens} tokens ({memory})",
             f"bytes equal: {equal}; the engine thread waited {1000 * queued_s:.2f} ms, "
             f"the copy took {1000 * copied_s:.2f} ms ({nbytes / copied_s / 1e9:.2f} GB/s)")]


def out_of_memory_retry(engine: Engine) -> list[tuple[str, str]]:
    """Fill the device until an allocation fails, then check that a forward still runs after the
    runner's retry (which offloads idle caches and empties the allocator's cache)."""
    device = engine.loaded.device
    if device.type != "cuda":
        return [("out-of-memory retry", "not run: only a CUDA device runs out of memory this way")]
    ballast = []
    try:
        while True:
            ballast.append(torch.empty(256 * 2**20, dtype=torch.uint8, device=device))
    except torch.cuda.OutOfMemoryError:
        ballast.pop()  # leave a little room for the retry
    try:
        with torch.inference_mode():
            engine.runner.forward(CacheEntry(engine.runner.new_cache()), torch.randint(100, 1000, (64,)).tolist())
        outcome = "the forward ran"
    except torch.cuda.OutOfMemoryError:
        outcome = "still out of memory after the retry"
    del ballast
    torch.cuda.empty_cache()
    return [("out-of-memory retry", outcome)]


def deep_check_distances(engine: Engine, tokens: int, samples: int = 4) -> list[tuple[str, str]]:
    """Deep-check distances over clean caches: what the dtype's tolerance must stay above."""
    distances = []
    with torch.inference_mode():
        for _ in range(samples):
            entry = CacheEntry(engine.runner.new_cache())
            engine.runner.forward(entry, torch.randint(100, 1000, (tokens,)).tolist())
            distances.append(deep_check_distance(entry, engine.runner.forward, engine.runner.scratch_cache))
    return [(f"deep-check distance, clean {engine.loaded.model.dtype} caches of {tokens} tokens",
             f"max {max(distances):.2e}, mean {sum(distances) / len(distances):.2e}")]


def batched_against_single(engine: Engine, tokens: int, batch: int) -> list[tuple[str, str]]:
    """The same decode step batched and one row at a time: the largest logit difference."""
    with torch.inference_mode():
        entries = []
        for _ in range(batch):
            entry = CacheEntry(engine.runner.new_cache())
            engine.runner.forward(entry, torch.randint(100, 1000, (tokens,)).tolist())
            entries.append(entry)
        nexts = torch.randint(100, 1000, (batch,)).tolist()
        lengths = [entry.num_tokens for entry in entries]
        batched = torch.stack(engine.runner.decode(entries, [[token] for token in nexts]))[:, -1].float()
        for entry, length in zip(entries, lengths, strict=True):
            entry.crop(length)
        single = torch.stack([engine.runner.forward(entry, [token]).float()
                              for entry, token in zip(entries, nexts, strict=True)])
    agree = bool((batched.argmax(-1) == single.argmax(-1)).all())
    difference = float((batched - single).abs().max())
    return [(f"batched against single, batch {batch}",
             f"max |logit difference| {difference:.2e}; greedy tokens {'equal' if agree else 'differ'}")]


def decode_rates(engine: Engine, tokens: int, batches: list[int], steps: int = 8) -> list[tuple[str, str]]:
    rows = []
    device = engine.loaded.device
    with torch.inference_mode():
        for batch in batches:
            entries = []
            for _ in range(batch):
                entry = CacheEntry(engine.runner.new_cache())
                engine.runner.forward(entry, torch.randint(100, 1000, (tokens,)).tolist())
                entry.cache.reserve(tokens + steps + 1)
                entries.append(entry)
            nexts = torch.randint(100, 1000, (batch,)).tolist()
            engine.runner.decode(entries, [[token] for token in nexts])  # warm-up
            synchronize(device)
            started = time.perf_counter()
            for _ in range(steps):
                engine.runner.decode(entries, [[token] for token in nexts])
            synchronize(device)
            step_s = (time.perf_counter() - started) / steps
            rows.append((f"decode, batch {batch}, {tokens}-token caches",
                         f"{1000 * step_s:.1f} ms per step, {batch / step_s:.1f} tokens/s (no CUDA graphs yet)"))
            del entries
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=2048, help="cache length for the copies and checks")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64])
    parser.add_argument("--output", type=Path, default=HERE / "results" / "gpu_check.json")
    args = parser.parse_args()

    loaded = load_model(args.model, device=args.device)
    engine = Engine(lambda: loaded, Settings(device=args.device, model=args.model, max_batch=max(args.batches)))
    engine.start()
    engine.ready.wait()
    if engine.load_error is not None:
        raise SystemExit(f"gpu_check: {engine.load_error}")
    name = torch.cuda.get_device_name(loaded.device) if loaded.device.type == "cuda" else "CPU"
    rows = [("device", f"{loaded.device} ({name}), {loaded.model.dtype}, "
                       f"KV arena {engine.arena.nbytes() / 2**20:.0f} MB")]
    rows += offload_and_restore(engine, args.tokens)
    rows += fetched_copy_to_device(engine, args.tokens)
    rows += out_of_memory_retry(engine)
    rows += deep_check_distances(engine, min(args.tokens, 512))
    rows += batched_against_single(engine, min(args.tokens, 256), min(8, max(args.batches)))
    rows += decode_rates(engine, min(args.tokens, 512), args.batches)
    engine.stop()
    width = max(len(name) for name, _ in rows)
    print("\n".join(f"{name:<{width}}  {value}" for name, value in rows))
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(dict(rows), indent=2))


if __name__ == "__main__":
    main()
