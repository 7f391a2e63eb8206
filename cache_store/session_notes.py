"""What the cache store remembers about sessions apart from their caches: whose they are (the scope their chunks
are named for), how long their system prompt is, whether a client is connected, which lost their cache (their
next turn is an `evicted` miss), and which are kept resident until when (a cache breakpoint's ttl: the device
evicts them after every other idle cache, the host tier drops them after every other session's copy). Bounded:
the oldest notes go first."""

from __future__ import annotations

import time
from collections.abc import Callable

from cachetools import LRUCache

REMEMBERED_SESSIONS = 100_000
_UNKNOWN = object()


class SessionNotes:
    """Per-session facts the tiers and the lookup read, written by the turns."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.connected: set[str] = set()  # sessions with a client: evicted last
        self._kept: LRUCache[str, float] = LRUCache(REMEMBERED_SESSIONS)  # session id -> kept resident until
        self._lost: LRUCache[str, None] = LRUCache(REMEMBERED_SESSIONS)
        # session id -> its owner and its system prompt's length, as its turns said
        self._scopes: LRUCache[str, tuple[object, int]] = LRUCache(REMEMBERED_SESSIONS)

    def remember_owner(self, session_id: str, owner: str | None, prompt_tokens: int) -> None:
        self._scopes[session_id] = (owner, prompt_tokens)

    def owner_of(self, session_id: str) -> str | None:
        """The session's owner, as its last turn said (None: every owner's, or not known)."""
        owner, _ = self._scopes.get(session_id, (None, 0))
        return owner if isinstance(owner, str) else None

    def scope_of(self, session_id: str) -> str:
        """Whose chunks the session's cache is made of: its owner's (every owner's when the server has no keys);
        a session never looked up here (no owner known) has chunks of its own."""
        owner, _ = self._scopes.get(session_id, (_UNKNOWN, 0))
        return f"session:{session_id}" if owner is _UNKNOWN else f"owner:{owner or '*'}"

    def prompt_tokens(self, session_id: str) -> int:
        """The length of the session's system prompt, as its last turn said (0: none, or not known)."""
        return self._scopes.get(session_id, (None, 0))[1]

    def keep(self, session_id: str, seconds: float) -> None:
        """Keep the session's cache resident (device first, then host) for `seconds` more, ahead of plain LRU."""
        self._kept[session_id] = max(self._kept.get(session_id, 0.0), self._clock() + seconds)

    def kept(self, session_id: str) -> bool:
        """Whether the session's cache is kept resident now."""
        return self._kept.get(session_id, float("-inf")) > self._clock()

    def kept_sessions(self) -> int:
        now = self._clock()
        return sum(until > now for until in self._kept.values())

    def lost(self, session_id: str) -> None:
        """The session's cache is gone from every tier: its next turn is an `evicted` miss."""
        self._lost[session_id] = None

    def was_lost(self, session_id: str) -> bool:
        return session_id in self._lost

    def found(self, session_id: str) -> None:
        """The session has a cache again."""
        self._lost.pop(session_id, None)

    def forget(self, session_id: str) -> None:
        """The session is closed: nothing about it is kept."""
        self._lost.pop(session_id, None)
        self._scopes.pop(session_id, None)
        self._kept.pop(session_id, None)
        self.connected.discard(session_id)
