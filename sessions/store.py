"""Where sessions live. In memory for now; the interface is async so a networked store fits it."""

from __future__ import annotations

from typing import Protocol

from sessions.state import Session, new_session_id


class SessionStore(Protocol):
    async def create(self, system: str | None) -> Session: ...
    async def get(self, session_id: str) -> Session | None: ...
    async def delete(self, session_id: str) -> bool: ...


class InMemorySessionStore:
    """Sessions of this process, lost when it exits."""

    def __init__(self) -> None:
        self._sessions: dict[str, Session] = {}

    async def create(self, system: str | None) -> Session:
        session = Session(session_id=new_session_id(), system=system)
        self._sessions[session.session_id] = session
        return session

    async def get(self, session_id: str) -> Session | None:
        return self._sessions.get(session_id)

    async def delete(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def __len__(self) -> int:
        return len(self._sessions)
