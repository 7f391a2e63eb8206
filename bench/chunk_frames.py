"""One chunk of a SmolLM2-sized cache (30 layers, 3 KV heads, 32 positions, head_dim 64, float32: 1.47 MB) as
Redis holds it: the time to encode it (a write) and to decode it (a fetch), and its bytes. Run for this checkout
and, with --a-checkout DIR, for another (the commit before, in a `git worktree`), each in a fresh process.

    .venv/bin/python bench/chunk_frames.py --a-checkout /tmp/w/before
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from common import checkouts, in_checkout, mean_ms

HERE = Path(__file__).resolve()


def worker(repeats: int) -> dict:
    """Encode and decode one chunk `repeats` times in this process (the checkout on PYTHONPATH)."""
    import torch

    from cache_store.checks.integrity import checksum
    from cache_store.remote.remote_format import StoredKV, decode_chunk, encode_chunk

    torch.manual_seed(0)
    piece = StoredKV([(torch.randn(1, 3, 32, 64), torch.randn(1, 3, 32, 64)) for _ in range(30)], None, "")
    piece.checksum = checksum(piece.stored)
    blob = encode_chunk("0" * 32, piece)

    return {"encode_ms": mean_ms(lambda: encode_chunk("0" * 32, piece), repeats),
            "decode_ms": mean_ms(lambda: decode_chunk(blob), repeats), "bytes": len(blob)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--a-checkout", type=Path, help="also measure this checkout (the commit before)")
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(int(args.worker))))
        return
    report = {label: in_checkout(HERE, checkout, str(args.repeats))
              for label, checkout in checkouts(HERE, args.a_checkout).items()}
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
