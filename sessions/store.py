"""Where sessions live. One async interface; in memory by default, Redis for deployments."""

from __future__ import annotations

from typing import Protocol

from sessions.state import Session, new_session_id


class VersionConflict(Exception):
    """Another writer completed a turn of the session first."""


class StoreUnavailable(Exception):
    """The store cannot be reached and has no local copy to answer from."""


class SessionBusy(Exception):
    """Another worker holds the session's lease: it is running a turn of it."""


class Lease(Protocol):
    """The right to run one turn of a session. `fence` grows with every lease of the session; a
    write carrying an older fence than the store's is refused."""

    fence: int | None

    async def release(self) -> None: ...


class LocalLease:
    """Within one process the gateway already runs one turn per session at a time."""

    fence = None

    async def release(self) -> None:
        return None


class SessionStore(Protocol):
    async def create(self, system: str | None, owner: str | None = None) -> Session: ...

    async def get(self, session_id: str) -> Session | None: ...

    async def lease(self, session_id: str) -> Lease:
        """Take the session's turn lease, waiting briefly; raise `SessionBusy` if another worker keeps it."""

    async def append_turn(self, session: Session, user_content: str, reply: str, token_ids: list[int],
                          lease: Lease | None = None, dropped_turns: int | None = None) -> None:
        """Record a completed turn atomically (messages, token ids, version, the turns its prompt left
        out) on `session` and in the store; raise `VersionConflict` if the stored version is no longer
        `session.version` or the lease was lost."""

    async def delete(self, session_id: str) -> bool: ...

    async def close(self) -> None: ...


class InMemorySessionStore:
    """Sessions of this process, lost when it exits."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    async def create(self, system: str | None, owner: str | None = None) -> Session:
        session = Session(session_id=new_session_id(), system=system, owner=owner)
        self._sessions[session.session_id] = session
        return session

    async def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    async def lease(self, session_id: str) -> Lease:
        return LocalLease()

    async def append_turn(self, session: Session, user_content: str, reply: str, token_ids: list[int],
                          lease: Lease | None = None, dropped_turns: int | None = None) -> None:
        stored = self._sessions.get(session.session_id)
        if stored is None or stored.version != session.version:
            raise VersionConflict(session.session_id)
        stored.record_turn(user_content, reply, token_ids, dropped_turns)
        if session is not stored:
            session.record_turn(user_content, reply, token_ids, dropped_turns)

    async def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    async def close(self) -> None:
        self._sessions.clear()

    def __len__(self) -> int:
        return len(self._sessions)
