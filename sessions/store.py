"""Where sessions live. One async interface; in memory by default, Redis for deployments."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Protocol

from sessions.state import Message, Session, ToolCall, new_session_id


class VersionConflict(Exception):
    """Another writer completed a turn of the session first."""


class StoreUnavailable(Exception):
    """The store cannot be reached and has no local copy to answer from."""


class SessionBusy(Exception):
    """Another worker holds the session's lease: it is running a turn of it."""


class Lease(Protocol):
    """The right to run one turn of a session. `fence` grows with every lease of the session; a
    write carrying an older fence than the store's is refused. `session`: the session as read in the
    lease's own round trip (None when it was not read with it)."""

    fence: int | None
    session: Session | None

    async def release(self) -> None: ...


class LocalLease:
    """Within one process the gateway already runs one turn per session at a time."""

    fence = None
    session = None

    async def release(self) -> None:
        return None


class SessionStore(Protocol):
    """Where sessions live: in memory, or in Redis."""

    durable: bool  # whether a write is acknowledged only once replicas hold it (never queued through an outage)

    async def create(self, system: str | None, owner: str | None = None, messages: Sequence[Message] = (),
                     tool_options: dict | None = None) -> Session:
        """A new session; `messages` is a history it starts with (a stateless client's branch), `tool_options`
        what its turns are asked with by default."""

    async def get(self, session_id: str) -> Session | None: ...

    async def lease(self, session_id: str) -> Lease:
        """Take the session's turn lease, waiting briefly; raise `SessionBusy` if another worker keeps it."""

    async def append_turn(self, session: Session, new: str | Sequence[Message], reply: str | None,
                          token_ids: list[int], lease: Lease | None = None, dropped_turns: int | None = None,
                          reply_ids: Sequence[int] | None = None, tool_calls: Sequence[ToolCall] = ()) -> None:
        """Record a completed turn atomically (its new messages, the reply and its calls (None: a warm-up, which
        has none), token ids, version, the turns its prompt left out) on `session` and in the store; raise
        `VersionConflict` if the stored version is no longer `session.version` or the lease was lost."""

    async def rewrite(self, session: Session, system: str | None, messages: Sequence[Message], removed_items: int,
                      dropped_turns: int) -> None:
        """Replace the session's history (an item deleted) atomically, as a new version, on `session` and in the store;
        raise `VersionConflict` if the stored version is no longer `session.version`, `SessionBusy` while a worker
        holds its lease."""

    async def delete(self, session_id: str) -> bool: ...

    async def reachable(self) -> bool:
        """Whether the store answers now (a readiness probe's question)."""

    async def flush(self) -> None:
        """Write what is queued, trying once (at shutdown, before anything slower)."""

    async def close(self) -> None: ...


class InMemorySessionStore:
    """Sessions of this process, lost when it exits. A session unused for `retention_s` is forgotten,
    as Redis forgets it, so that abandoned conversations do not grow the process without bound."""

    durable = False

    def __init__(self, retention_s: float | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.retention_s = retention_s
        self._clock = clock
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self._used_at: dict[str, float] = {}

    async def create(self, system: str | None, owner: str | None = None, messages: Sequence[Message] = (),
                     tool_options: dict | None = None) -> Session:
        self._forget_idle()
        session = Session(session_id=new_session_id(), system=system, owner=owner, messages=list(messages),
                          tool_options=tool_options)
        self._use(session)
        return session

    async def get(self, session_id: str) -> Session | None:
        self._forget_idle()
        session = self._sessions.get(session_id)
        if session is not None:
            self._use(session)
        return session

    async def lease(self, session_id: str) -> Lease:
        return LocalLease()

    async def append_turn(self, session: Session, new: str | Sequence[Message], reply: str | None,
                          token_ids: list[int], lease: Lease | None = None, dropped_turns: int | None = None,
                          reply_ids: Sequence[int] | None = None, tool_calls: Sequence[ToolCall] = ()) -> None:
        stored = self._sessions.get(session.session_id)
        if stored is None or stored.version != session.version:
            raise VersionConflict(session.session_id)
        stored.record_turn(new, reply, token_ids, dropped_turns, reply_ids, tool_calls)
        if session is not stored:
            session.record_turn(new, reply, token_ids, dropped_turns, reply_ids, tool_calls)
        self._use(stored)

    async def rewrite(self, session: Session, system: str | None, messages: Sequence[Message], removed_items: int,
                      dropped_turns: int) -> None:
        stored = self._sessions.get(session.session_id)
        if stored is None or stored.version != session.version:
            raise VersionConflict(session.session_id)
        stored.rewrite(system, messages, removed_items, dropped_turns)
        if session is not stored:
            session.rewrite(system, messages, removed_items, dropped_turns)
        self._use(stored)

    async def delete(self, session_id: str) -> bool:
        self._used_at.pop(session_id, None)
        return self._sessions.pop(session_id, None) is not None

    async def reachable(self) -> bool:
        return True

    async def flush(self) -> None:
        return None  # (nothing is ever queued)

    async def close(self) -> None:
        self._sessions.clear()
        self._used_at.clear()

    def __len__(self) -> int:
        return len(self._sessions)

    def _use(self, session: Session) -> None:
        self._sessions[session.session_id] = session
        self._sessions.move_to_end(session.session_id)
        self._used_at[session.session_id] = self._clock()

    def _forget_idle(self) -> None:
        if self.retention_s is None:
            return
        deadline = self._clock() - self.retention_s
        while self._sessions:
            oldest = next(iter(self._sessions))
            if self._used_at[oldest] >= deadline:
                return
            del self._sessions[oldest], self._used_at[oldest]
