"""Cost of the consistency checks per turn, as a share of time to first token, at long histories.

For each --history-tokens, builds one real SmolLM2 cache of that length, then times, with the same
code the cache store and engine run: the checks of every reuse of a device-resident cache (fingerprint,
lengths, shapes, the checksum of its bytes, finite logits), the checksum taken at write-back (after the
reply, off the TTFT path), the extra checks of a restore from the host tier (checksum, finite values),
and the sampled deep check, against the TTFT of a turn that reuses the cache (prefill of a typical
new message on top of it).

    .venv/bin/python bench/check_cost.py [--history-tokens 512 2048]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from common import median_ms, write_result

from cache_store import CacheEntry, CacheLayout, KVGeometry, Offloader
from cache_store.checks.integrity import check_finite, check_identity, check_tensors, checksum, fingerprint
from chatd.config import Settings
from chatd.engine.deep_check import deep_check_distance
from chatd.engine.engine import Engine
from chatd.model.loader import load_model

HERE = Path(__file__).parent
NEW_MESSAGE_TOKENS = 32


def measure(engine: Engine, layout: CacheLayout, history_tokens: int, repeats: int) -> dict:
    history = torch.randint(100, 40_000, (history_tokens,)).tolist()
    new_tokens = torch.randint(100, 40_000, (NEW_MESSAGE_TOKENS,)).tolist()
    with torch.inference_mode():
        entry = CacheEntry(engine.runner.new_cache())
        engine.runner.forward(entry, history)
        stamp = fingerprint(entry, "model", "session", layout)

        def reuse_turn() -> None:  # what a device hit costs until the first token: prefill the new message
            entry.crop(history_tokens)
            engine.runner.forward(entry, new_tokens)

        ttft_ms = median_ms(reuse_turn, max(5, repeats // 4))
        entry.crop(history_tokens)  # a cropped view, as a reused cache is
        written_back = checksum(entry.tensors())
        identity_ms = median_ms(lambda: (check_identity(stamp, "model", "session", entry.token_ids, layout),
                                         check_tensors(entry.tensors(), entry.num_tokens, layout)), repeats)
        checksum_ms = median_ms(lambda: checksum(entry.tensors()) == written_back, repeats)
        logits = engine.runner.forward(CacheEntry(engine.runner.new_cache()), new_tokens)
        logits_finite_ms = median_ms(lambda: bool(torch.isfinite(logits).all()), repeats)
        host = Offloader(engine.loaded.device).offload(entry)
        restore_ms = median_ms(lambda: (checksum(host.tensors), check_finite(host.tensors)), repeats)
        deep_ms = median_ms(lambda: deep_check_distance(entry, engine.runner.forward, engine.runner.new_cache), 3)
    return {"history_tokens": history_tokens, "cache_mb": entry.nbytes() / 2**20, "reuse_ttft_ms": ttft_ms,
            "identity_checks_ms": identity_ms + logits_finite_ms, "resident_checksum_ms": checksum_ms,
            "restore_checks_ms": restore_ms, "deep_check_ms": deep_ms}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--history-tokens", type=int, nargs="+", default=[512, 2048])
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
    rows = [measure(engine, layout, tokens, args.repeats) for tokens in args.history_tokens]
    engine.stop()

    rate = Settings().verify_sample_rate
    print(f"{loaded.device} ({loaded.model.dtype}), {torch.get_num_threads()} threads; TTFT = prefill of "
          f"{NEW_MESSAGE_TOKENS} new tokens on the cache")
    for row in rows:
        ttft = row["reuse_ttft_ms"]
        every_reuse = row["identity_checks_ms"] + row["resident_checksum_ms"]
        print(f"{row['history_tokens']}-token history ({row['cache_mb']:.1f} MB), TTFT {ttft:.1f} ms")
        print(f"  every reuse: fingerprint, lengths, shapes, finite logits {row['identity_checks_ms']:.3f} ms; "
              f"checksum of the resident bytes {row['resident_checksum_ms']:.2f} ms; together "
              f"{every_reuse:.2f} ms = {100 * every_reuse / ttft:.2f}% of TTFT")
        print(f"  at write-back (after the reply): the checksum again, {row['resident_checksum_ms']:.2f} ms")
        print(f"  restore from host (checksum, finite values): {row['restore_checks_ms']:.1f} ms "
              f"= {100 * row['restore_checks_ms'] / ttft:.1f}% of TTFT")
        print(f"  deep check when sampled: {row['deep_check_ms']:.0f} ms = {row['deep_check_ms'] / ttft:.1f}x TTFT; "
              f"at the default rate {rate:g}: {100 * rate * row['deep_check_ms'] / ttft:.1f}% of TTFT on average")
    write_result(args.output, {"device": str(loaded.device), "dtype": str(loaded.model.dtype),
                               "torch_threads": torch.get_num_threads(), "default_sample_rate": rate, "rows": rows})


if __name__ == "__main__":
    main()
