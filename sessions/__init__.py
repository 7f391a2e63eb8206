"""Session state and the stores that keep it. Never imports chatd."""

from sessions.state import Message, Role, Session, new_session_id
from sessions.store import (
    InMemorySessionStore,
    Lease,
    LocalLease,
    SessionBusy,
    SessionStore,
    StoreUnavailable,
    VersionConflict,
)

__all__ = ["InMemorySessionStore", "Lease", "LocalLease", "Message", "Role", "Session", "SessionBusy", "SessionStore",
           "StoreUnavailable", "VersionConflict", "new_session_id"]
