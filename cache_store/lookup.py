"""What crosses the cache boundary: the lookup a turn gets back, and why a session's cache is busy."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, TypeVar

from cache_store.checks.integrity import Check
from cache_store.device.entry import CacheEntry
from cache_store.remote.cost_model import RemoteDecision

CacheSource = Literal["device", "host", "remote", "prefix", "miss"]
CopyObserver = Callable[[Literal["offload", "restore"], Literal["host", "remote"], float], None]
T = TypeVar("T")
MissReason = Literal["new", "cold", "evicted", "disabled", "drift", "corrupt", "stale", "truncated"]

class SessionRunning(RuntimeError):
    """A turn of the session is running: its cache is that turn's until write-back. Retry later."""


@dataclass(frozen=True)
class CacheQuery:
    """What a turn asks of the cache store, the same for its request to Redis and its lookup: the session, the
    prompt's ids, how many of them are its system prompt (which the owner's sessions share), the completed turns the
    prompt includes (a cache older than that is stale), and whose caches it may share (`owner`: the API key's id;
    None: the server has no keys)."""

    session_id: str
    prompt_ids: Sequence[int]
    prefix_len: int = 0
    session_version: int = 0
    owner: str | None = None


@dataclass(frozen=True)
class CacheLookup:
    """What a turn may reuse: `entry` holds its first `cached_tokens` tokens and stays the turn's
    until `put` (or `drop`)."""

    source: CacheSource
    cached_tokens: int
    entry: CacheEntry | None = None
    miss_reason: MissReason | None = None
    cleared: tuple[Check, ...] = ()  # the checks that failed: a "corrupt" miss, or a host chain's later copy
    remote: RemoteDecision | None = None  # when a remote cache existed: fetched or recomputed, and why

    @property
    def quantized(self) -> str | None:
        """"int8" when the reused cache came (now or at an earlier turn) from a quantised copy."""
        return self.entry.quantized if self.entry is not None and self.cached_tokens else None


def common_prefix_length(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading ids two sequences share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
