"""The cache boundary: a turn asks what it may reuse and gets one `CacheLookup` back."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from cache_store.device_tier import DeviceTier
from cache_store.entry import CacheEntry

CacheSource = Literal["device", "miss"]
MissReason = Literal["new", "disabled", "drift"]


@dataclass(frozen=True)
class CacheLookup:
    """What a turn may reuse. `entry` is owned by the turn until it is stored back."""

    source: CacheSource
    cached_tokens: int
    entry: CacheEntry | None = None
    miss_reason: MissReason | None = None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class CacheManager:
    """Looks up, crops and stores session caches. With `enabled` false every turn is a miss:
    the baseline that benchmarks compare against."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.device = DeviceTier()

    def lookup(self, session_id: str, prompt_ids: Sequence[int]) -> CacheLookup:
        if not self.enabled:
            return CacheLookup(source="miss", cached_tokens=0, miss_reason="disabled")
        entry = self.device.take(session_id)
        if entry is None:
            return CacheLookup(source="miss", cached_tokens=0, miss_reason="new")
        # The last prompt token is always fed again: its logits choose the first reply token.
        reusable = min(common_prefix_length(entry.token_ids, prompt_ids), len(prompt_ids) - 1)
        if reusable <= 0:
            return CacheLookup(source="miss", cached_tokens=0, miss_reason="drift")
        entry.crop(reusable)
        return CacheLookup(source="device", cached_tokens=reusable, entry=entry)

    def store(self, session_id: str, entry: CacheEntry) -> None:
        if self.enabled and entry.num_tokens > 0:
            self.device.put(session_id, entry)

    def drop(self, session_id: str) -> bool:
        return self.device.drop(session_id)
