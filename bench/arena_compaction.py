"""The KV arena's free list and compaction: best fit against first fit under churn, and the pause a
compaction adds at 16 and 64 resident sessions.

Churn: sessions of mixed lengths take turns in random order under a fixed budget (each turn reserves its
prompt plus reply, writes them, and shrinks to its cache at write-back; the least recently used idle cache
is evicted when no room is left), on an arena of one float32 per token so that only the bookkeeping counts.
Pause: an arena with SmolLM2-135M's geometry (30 layers, 3 KV heads, head_dim 64, float32) full of resident
caches of 300 to 700 tokens, every other one then freed, and a region asked for that is longer than any
free run: the compaction that makes room is timed and its bytes counted.

    .venv/bin/python bench/arena_compaction.py [--turns 20000] [--sessions 16 64]
"""

from __future__ import annotations

import argparse
import random
from collections import OrderedDict
from pathlib import Path

import torch
from common import write_result

from cache_store.device.allocator import RunAllocator
from cache_store.device.arena import ArenaCache, KVArena

HERE = Path(__file__).parent
SMOLLM2 = {"layers": 30, "kv_heads": 3, "head_dim": 64}


def churn(fit: str, turns: int, sessions: int, budget_tokens: int, longest: int, seed: int) -> dict:
    """Random turns of `sessions` conversations (each ends past `longest` tokens and a new one starts) under
    `budget_tokens`: compactions, tokens moved, evictions."""
    rng = random.Random(seed)
    resident: OrderedDict[int, ArenaCache] = OrderedDict()  # least recently used first
    evictions = 0

    def evict_one(tokens: int) -> bool:
        nonlocal evictions
        if not resident:
            return False
        resident.popitem(last=False)  # dropping the cache frees its region
        evictions += 1
        return True

    arena = KVArena(1, 1, 1, torch.float32, torch.device("cpu"), budget_tokens, make_room=evict_one)
    arena.allocator = RunAllocator(arena.tokens // 16, fit=fit)
    lengths = [0] * sessions
    for _ in range(turns):
        session = rng.randrange(sessions)
        cache = resident.pop(session, None)
        if cache is None:  # evicted: its history comes back (restored or recomputed) into a new region
            cache = ArenaCache(arena)
        prompt, reply = rng.randint(20, 120), rng.randint(16, 96)
        if lengths[session] + prompt + reply > longest:
            lengths[session] = 0  # the conversation ends; a new one takes its place
            cache = ArenaCache(arena)
        cache.reserve(lengths[session] + prompt + reply)
        cache.layers[0].length = lengths[session] = lengths[session] + prompt + reply
        cache.fit()
        resident[session] = cache
    return {"fit": fit, "turns": turns, "compactions": arena.compactions,
            "tokens_moved": arena.compaction_bytes // arena.bytes_per_token, "evictions": evictions}


def pause(sessions: int, whole: bool, seed: int) -> dict:
    """The compaction that makes room for one region among `sessions` resident caches, every other one freed:
    a region just longer than the longest free run, or (`whole`) one as long as all free units together,
    which slides every cache."""
    rng = random.Random(seed)
    lengths = [rng.randint(300, 700) for _ in range(sessions)]
    arena = KVArena(SMOLLM2["layers"], SMOLLM2["kv_heads"], SMOLLM2["head_dim"], torch.float32,
                    torch.device("cpu"), sum(-(-n // 16) * 16 for n in lengths))
    caches = []
    for length in lengths:
        cache = ArenaCache(arena)
        shape = (1, SMOLLM2["kv_heads"], length, SMOLLM2["head_dim"])
        cache.load([(torch.randn(shape), torch.randn(shape)) for _ in range(SMOLLM2["layers"])])
        caches.append(cache)
    del caches[::2]  # every other cache leaves: free runs of 300 to 700 tokens between the rest
    free = arena.stats()
    asked = free["arena_free_tokens"] if whole else free["arena_largest_free_tokens"] + 16
    long_one = ArenaCache(arena)
    long_one.reserve(asked)  # longer than any free run: the arena compacts
    stats = arena.stats()
    moved = stats["arena_compaction_bytes"]
    return {"sessions": sessions, "whole": whole, "resident": len(caches), "arena_mb": arena.nbytes() / 2**20,
            "asked_tokens": asked, "compactions": stats["arena_compactions"], "moved_mb": moved / 2**20,
            "pause_ms": 1000 * stats["arena_compaction_seconds"],
            "gb_per_s": moved / stats["arena_compaction_seconds"] / 1e9 if moved else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--turns", type=int, default=20000)
    parser.add_argument("--churn-sessions", type=int, default=40)
    parser.add_argument("--budget-tokens", type=int, default=16384)
    parser.add_argument("--longest", type=int, default=1500, help="a conversation ends past this many tokens")
    parser.add_argument("--sessions", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=HERE / "results" / "arena_compaction.json")
    args = parser.parse_args()
    torch.set_grad_enabled(False)

    fits = [churn(fit, args.turns, args.churn_sessions, args.budget_tokens, args.longest, args.seed)
            for fit in ("best", "first")]
    for row in fits:
        print(f"{row['fit']:>5} fit: {row['compactions']:5d} compactions, {row['tokens_moved']:8d} tokens moved, "
              f"{row['evictions']:5d} evictions in {row['turns']} turns", flush=True)
    pauses = [pause(sessions, whole, args.seed) for sessions in args.sessions for whole in (False, True)]
    for row in pauses:
        asked = "all free units" if row["whole"] else "just past the longest free run"
        print(f"{row['sessions']:3d} sessions ({row['resident']} left resident, arena {row['arena_mb']:.0f} MB), "
              f"{asked}: a {row['asked_tokens']}-token region compacted in {row['pause_ms']:.1f} ms, "
              f"{row['moved_mb']:.0f} MB moved ({row['gb_per_s']:.1f} GB/s)", flush=True)
    write_result(args.output, {"torch_threads": torch.get_num_threads(), "churn": fits, "pause": pauses})


if __name__ == "__main__":
    main()
