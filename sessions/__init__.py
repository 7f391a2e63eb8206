"""Session state and the stores that keep it. Never imports chatd."""

from sessions.state import Message, Role, Session, ToolCall, as_inputs, new_session_id
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
           "StoreUnavailable", "ToolCall", "VersionConflict", "as_inputs", "new_session_id"]
