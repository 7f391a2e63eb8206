"""What crosses the cache boundary: the lookup a turn gets back, why a session's cache is busy, and what the
store asks of a remote tier."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from cache_store.cost_model import RemoteDecision, Throughput
from cache_store.entry import CacheEntry
from cache_store.integrity import Check
from cache_store.remote_format import RemoteCopy, RemoteHeader, RemoteSnapshot

CacheSource = Literal["device", "host", "remote", "prefix", "miss"]
CopyObserver = Callable[[Literal["offload", "restore"], Literal["host", "remote"], float], None]
T = TypeVar("T")
MissReason = Literal["new", "cold", "evicted", "disabled", "drift", "corrupt", "stale", "truncated"]

class SessionRunning(RuntimeError):
    """A turn of the session is running: its cache is that turn's until write-back. Retry later."""


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


class RemoteCaches(Protocol):
    """Where caches are shared beyond this process (`RemoteTier`: Redis, as chains of chunks): what the store asks
    of it. `head`, `fetch` and `usage`'s refresh talk to Redis: they run on its own threads (`submit`), never the
    engine's; `put`, `delete` and `delete_chunk` only queue."""

    throughput: Throughput
    errors: int
    write_errors: int
    chunk_tokens: int
    timeout_s: float
    counters: dict[str, int]

    @property
    def reachable(self) -> bool: ...

    def submit(self, job: Callable[[], T]) -> Future[T]: ...

    def known_chunks(self, chunks: list[str]) -> int: ...

    def chunks_known(self) -> int: ...

    def pending(self) -> dict[str, int]: ...

    def put(self, session_id: str, snapshot: RemoteSnapshot) -> None: ...

    def head(self, session_id: str) -> RemoteHeader | None: ...

    def fetch(self, header: RemoteHeader, first: int = 0) -> RemoteCopy | None: ...

    def delete(self, session_id: str, up_to_version: int) -> None: ...

    def delete_chunk(self, name: str) -> None: ...

    def usage(self) -> tuple[int, int]: ...
