"""Why a turn was refused or failed, as every API's turn start reports it: chatd's error codes, and the message that
carries one (the websocket protocol's `error` frame, which the HTTP APIs turn into their own error bodies)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

ErrorCode = Literal["bad_request", "unauthorized", "unknown_session", "unknown_turn", "busy", "rate_limited",
                    "limit_exceeded", "too_long", "context_length_exceeded", "unavailable", "conflict", "internal"]


class ErrorMessage(BaseModel):
    """A request that failed: a code, a message, and whether to retry."""

    type: Literal["error"] = "error"
    turn_id: str | None = None
    code: ErrorCode
    message: str
    retryable: bool = False
    retry_after_s: float | None = None  # when to retry, for rate_limited
