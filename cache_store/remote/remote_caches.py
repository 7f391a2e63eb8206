"""What the cache store asks of a tier that shares caches beyond this process: `RemoteTier` (Redis) is the one there
is; the store, its lookups and its moves depend on this shape only."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Protocol, TypeVar

from cache_store.remote.cost_model import Throughput
from cache_store.remote.remote_format import RemoteCopy, RemoteHeader, RemoteSnapshot

T = TypeVar("T")


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
