"""What the cache store remembers about sessions apart from their caches: whose they are (the scope their chunks
are named for), how long their system prompt is, whether a client is connected, and which lost their cache (their
next turn is an `evicted` miss). Bounded: the oldest notes go first."""

from __future__ import annotations

from cachetools import LRUCache

REMEMBERED_SESSIONS = 100_000
_UNKNOWN = object()


class SessionNotes:
    """Per-session facts the tiers and the lookup read, written by the turns."""

    def __init__(self) -> None:
        self.connected: set[str] = set()  # sessions with a client: evicted last
        self._lost: LRUCache[str, None] = LRUCache(REMEMBERED_SESSIONS)
        # session id -> its owner and its system prompt's length, as its turns said
        self._scopes: LRUCache[str, tuple[object, int]] = LRUCache(REMEMBERED_SESSIONS)

    def remember_scope(self, session_id: str, owner: str | None, prompt_tokens: int) -> None:
        self._scopes[session_id] = (owner, prompt_tokens)

    def scope_of(self, session_id: str) -> str:
        """Whose chunks the session's cache is made of: its owner's (every owner's when the server has no keys);
        a session never looked up here (no owner known) has chunks of its own."""
        owner, _ = self._scopes.get(session_id, (_UNKNOWN, 0))
        return f"session:{session_id}" if owner is _UNKNOWN else f"owner:{owner or '*'}"

    def prompt_tokens(self, session_id: str) -> int:
        """The length of the session's system prompt, as its last turn said (0: none, or not known)."""
        return self._scopes.get(session_id, (None, 0))[1]

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
        self.connected.discard(session_id)
