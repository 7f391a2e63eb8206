"""The deep consistency check: does the cache still give the logits that a recompute gives?"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers import DynamicCache

from cache_store import CacheEntry

# Relative logit distance above which a reused cache is declared corrupt. With SmolLM2 in float32,
# healthy caches measure about 1e-6 and one flipped exponent bit across one layer's keys or values
# about 4e-2. Half precision is noisier; its bound is an estimate not yet measured on a GPU.
DEEP_CHECK_TOLERANCE = {torch.float64: 1e-3, torch.float32: 1e-3, torch.float16: 5e-2, torch.bfloat16: 5e-2}
# A cache restored from an int8 copy: over 25 restores of the bench scenarios' histories (SmolLM2,
# float32, `bench/int8_accuracy.py`) the distance was 3.1e-3 to 1.5e-2 (median 5.7e-3); 5e-2 leaves room.
# It is close to what one flipped exponent bit gives, so for such caches the deep check catches only
# gross damage; the checksum of the int8 bytes and scales still catches every flipped byte at rest.
DEEP_CHECK_TOLERANCE_INT8 = 5e-2


class DeepCheck:
    """The deep check of one reuse, run like any prefill: the cache's tokens recomputed from scratch in a transient
    cache, `advance` by `advance` (a few hundred tokens between the others' decode steps, so that a long history
    never holds them up), then the logits of its last token from the cache compared with those (`distance`)."""

    def __init__(self, entry: CacheEntry, scratch: CacheEntry):
        self.entry, self.scratch = entry, scratch
        self._from_scratch: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self._from_scratch is not None

    def advance(self, forward: Callable[[CacheEntry, list[int]], torch.Tensor], budget: int) -> int:
        """Recompute up to `budget` more of the cache's tokens from scratch; how many it did."""
        start = self.scratch.num_tokens
        chunk = self.entry.token_ids[start:start + budget]
        logits = forward(self.scratch, chunk)
        if self.scratch.num_tokens == self.entry.num_tokens:
            self._from_scratch = logits.float()
        return len(chunk)

    def distance(self, forward: Callable[[CacheEntry, list[int]], torch.Tensor]) -> float:
        """How far the cache's logits for its last token are from the recompute's (largest absolute difference over
        the largest absolute logit). The entry ends as it started: its last token is fed again on top of the
        rest."""
        last = self.entry.token_ids[-1]
        self.entry.crop(self.entry.num_tokens - 1)
        from_cache = forward(self.entry, [last]).float()
        from_scratch = self._from_scratch
        if not bool(torch.isfinite(from_cache).all()):
            return float("inf")
        return float((from_cache - from_scratch).abs().max() / from_scratch.abs().max().clamp_min(1e-6))


def deep_check_distance(entry: CacheEntry, forward: Callable[[CacheEntry, list[int]], torch.Tensor],
                        new_cache: Callable[[], DynamicCache]) -> float:
    """The deep check of `entry` at once (benchmarks and device checks; the engine runs it in chunks)."""
    check = DeepCheck(entry, CacheEntry(new_cache()))
    check.advance(forward, entry.num_tokens)
    return check.distance(forward)
