"""Cost of the consistency checks per turn, as a share of time to first token, at a long history.

Builds one real SmolLM2 cache of about --history-tokens tokens, then times, with the same code the
cache store and engine run: the cheap checks of every reuse (fingerprint, lengths, shapes), the extra
checks of a restore from the host tier (checksum, finite values), and the sampled deep check, against
the TTFT of a turn that reuses the cache (prefill of a typical new message on top of it).

    .venv/bin/python bench/check_cost.py [--history-tokens 2048]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import median_ms, write_result

from cache_store import CacheEntry, CacheLayout, KVGeometry, Offloader
from cache_store.integrity import check_finite, check_identity, check_tensors, checksum, fingerprint
from chatd.config import Settings
from chatd.deep_check import deep_check_distance
from chatd.engine import Engine
from chatd.model_loader import load_model

HERE = Path(__file__).parent
NEW_MESSAGE_TOKENS = 32


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history-tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--output", type=Path, default=HERE / "results" / "check_cost.json")
    args = parser.parse_args()

    loaded = load_model("smollm2-135m", device=args.device)
    engine = Engine(lambda: loaded, Settings(device=args.device))
    engine.start()
    engine.ready.wait()
    geometry = KVGeometry.of(loaded.model.config)
    layout = CacheLayout(geometry.layers, geometry.kv_heads, geometry.head_dim, loaded.model.dtype)
    history = torch.randint(100, 40_000, (args.history_tokens,)).tolist()
    new_tokens = torch.randint(100, 40_000, (NEW_MESSAGE_TOKENS,)).tolist()
    with torch.inference_mode():
        entry = CacheEntry(engine.runner.new_cache())
        engine.runner.forward(entry, history)
        stamp = fingerprint(entry, "model", "session", layout)

        def reuse_turn() -> None:  # what a device hit costs until the first token: prefill the new message
            entry.crop(args.history_tokens)
            engine.runner.forward(entry, new_tokens)

        ttft_ms = median_ms(reuse_turn, max(5, args.repeats // 4))
        entry.crop(args.history_tokens)
        cheap_ms = median_ms(lambda: (check_identity(stamp, "model", "session", entry.token_ids, layout),
                                      check_tensors(entry.tensors(), entry.num_tokens, layout)), args.repeats)
        logits = engine.runner.forward(CacheEntry(engine.runner.new_cache()), new_tokens)
        logits_finite_ms = median_ms(lambda: bool(torch.isfinite(logits).all()), args.repeats)
        host = Offloader(loaded.device).offload(entry)
        restore_ms = median_ms(lambda: (checksum(host.tensors), check_finite(host.tensors)), args.repeats)
        deep_ms = median_ms(lambda: deep_check_distance(entry, engine.runner.forward, engine.runner.new_cache), 3)
    engine.stop()

    rate = Settings().verify_sample_rate
    result = {
        "history_tokens": args.history_tokens, "device": str(loaded.device), "dtype": str(loaded.model.dtype),
        "torch_threads": torch.get_num_threads(), "reuse_ttft_ms": ttft_ms,
        "cheap_checks_ms": cheap_ms + logits_finite_ms, "restore_checks_ms": restore_ms, "deep_check_ms": deep_ms,
        "default_sample_rate": rate,
    }
    cheap_share = result["cheap_checks_ms"] / ttft_ms
    print(f"{args.history_tokens}-token history on {loaded.device} ({loaded.model.dtype}); "
          f"TTFT of a reuse (prefill of {NEW_MESSAGE_TOKENS} new tokens): {ttft_ms:.1f} ms")
    print(f"  cheap checks on every reuse (fingerprint, lengths, shapes, finite logits): "
          f"{result['cheap_checks_ms']:.3f} ms = {100 * cheap_share:.2f}% of TTFT")
    print(f"  extra checks of a restore from host (checksum, finite values): {restore_ms:.1f} ms "
          f"= {100 * restore_ms / ttft_ms:.1f}% of TTFT")
    print(f"  deep check when sampled: {deep_ms:.0f} ms = {deep_ms / ttft_ms:.1f}x TTFT; at the default rate "
          f"{rate:g}: {rate * deep_ms:.1f} ms per reuse on average = {100 * rate * deep_ms / ttft_ms:.1f}% of TTFT")
    write_result(args.output, result)


if __name__ == "__main__":
    main()
