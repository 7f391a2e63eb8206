"""Session state and the stores that keep it. Never imports chatd."""

from sessions.state import Message, Role, Session, new_session_id
from sessions.store import InMemorySessionStore, SessionStore, StoreUnavailable, VersionConflict

__all__ = ["InMemorySessionStore", "Message", "Role", "Session", "SessionStore", "StoreUnavailable",
           "VersionConflict", "new_session_id"]
