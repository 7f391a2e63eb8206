"""Which sessions' conversations begin with given token ids: the index that lets a stateless client
(one that resends the whole conversation and no session id) land on the session that holds its cache.

Each session's conversation ids are cut into blocks of `BLOCK` tokens and hashed as a chain (each
block's hash covers every block before it), seeded with the owner, so one owner's lookups never reach
another owner's sessions. A lookup walks the request's chain to the deepest block some session shares
and returns those sessions, deepest first; the caller verifies against the real ids (a hash is only a
hint).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence

from sessions.encoding import chained_token_hashes

BLOCK = 16  # tokens per hashed block
MAX_CANDIDATES = 8
MAX_SESSIONS = 100_000  # sessions indexed in one worker's memory (about 100 bytes a block: tens of MB at most)


def block_hashes(owner: str | None, token_ids: Sequence[int]) -> list[str]:
    """The chained hash of every full block of `token_ids`, under the owner."""
    return chained_token_hashes(token_ids, BLOCK, owner or "")


class PrefixIndex:
    """Chained block hashes of each session's conversation ids, per owner, to find a resent conversation's session;
    bounded: at most `max_sessions`, each forgotten `ttl_s` after it was last indexed (as its session is), the least
    recently indexed first."""

    def __init__(self, max_sessions: int = MAX_SESSIONS, ttl_s: float = float("inf"),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.max_sessions, self.ttl_s, self._clock = max_sessions, ttl_s, clock
        self.forgotten = 0  # sessions dropped to stay within the bounds (expired, or the least recently indexed)
        self._hashes: OrderedDict[str, tuple[list[str], float]] = OrderedDict()  # session -> its chain, indexed at
        self._sessions: dict[str, set[str]] = {}  # chained hash -> sessions whose conversation has that prefix

    def __len__(self) -> int:
        return len(self._hashes)

    def add(self, owner: str | None, session_id: str, token_ids: Sequence[int]) -> None:
        """Index (or re-index) a session by the ids its conversation has reached."""
        self.remove(session_id)
        hashes = block_hashes(owner, token_ids)
        self._hashes[session_id] = (hashes, self._clock())
        for chained in hashes:
            self._sessions.setdefault(chained, set()).add(session_id)
        self._trim()

    def remove(self, session_id: str) -> None:
        hashes, _ = self._hashes.pop(session_id, ((), 0.0))
        for chained in hashes:
            holders = self._sessions[chained]
            holders.discard(session_id)
            if not holders:
                del self._sessions[chained]

    def _trim(self) -> None:
        """Forget the least recently indexed sessions beyond the bound, and those indexed longer ago than the TTL."""
        deadline = self._clock() - self.ttl_s
        while self._hashes:
            oldest, (_, indexed_at) = next(iter(self._hashes.items()))
            if len(self._hashes) <= self.max_sessions and indexed_at >= deadline:
                return
            self.remove(oldest)
            self.forgotten += 1

    def candidates(self, owner: str | None, token_ids: Sequence[int]) -> list[str]:
        """Sessions of `owner` whose conversation shares the most leading blocks with `token_ids`,
        deepest first (at most MAX_CANDIDATES)."""
        self._trim()
        found: list[str] = []
        hashes = block_hashes(owner, token_ids)
        depth = self._deepest(hashes)
        for chained in reversed(hashes[:depth]):
            # Deeper blocks first; within one block in any order (a system prompt's blocks may be shared
            # by thousands of sessions: never sort or copy them all).
            for session_id in self._sessions[chained]:
                if session_id not in found:
                    found.append(session_id)
                    if len(found) == MAX_CANDIDATES:
                        return found
        return found

    def _deepest(self, hashes: list[str]) -> int:
        """How many leading blocks some session shares (a binary search: a shared block implies
        every block before it is shared too)."""
        low, high = 0, len(hashes)
        while low < high:
            middle = (low + high + 1) // 2
            if hashes[middle - 1] in self._sessions:
                low = middle
            else:
                high = middle - 1
        return low
