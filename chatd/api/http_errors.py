"""A failed HTTP API request, whatever API it came through: its status, message, the parameter at fault, chatd's
error code. Each API writes it in its own shape (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", ...}`):
the server installs one handler that picks the shape by the route's path."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import Response

from chatd.api.tool_calling import RequestRefused
from chatd.api.turn_errors import ErrorMessage
from chatd.engine.turn import TurnFailed
from sessions import StoreUnavailable

T = TypeVar("T")

# chatd's error codes (websocket protocol and engine) as HTTP statuses.
_STATUS = {"bad_request": 400, "limit_exceeded": 400, "too_long": 400, "unauthorized": 401, "unknown_session": 404,
           "rate_limited": 429, "conflict": 409, "busy": 503, "unavailable": 503, "internal": 500}
ErrorShape = Callable[["ApiError"], Response]


class ApiError(Exception):
    """A failed request: its status, and what each API's error body says."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, details: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s, self.details = retry_after_s, details  # (details: what Anthropic's errors carry)

    @classmethod
    def of(cls, error: ErrorMessage | TurnFailed) -> ApiError:
        return cls(_STATUS.get(error.code, 500), error.message, code=error.code,
                   retry_after_s=getattr(error, "retry_after_s", None))


async def store_call(work: Awaitable[T]) -> T:
    """A store's answer; an unreachable store (Redis) is a 503 (retryable; 529 to Anthropic's clients)."""
    try:
        return await work
    except StoreUnavailable as error:
        raise ApiError(503, f"{error}; try again shortly", code="unavailable") from None


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """A `RequestRefused` as a 400 naming the parameter."""
    try:
        yield
    except RequestRefused as error:
        raise ApiError(400, str(error), param=error.param, code="bad_request") from None


def install_error_handlers(app, default: ErrorShape, shapes: dict[str, ErrorShape]) -> None:
    """Every failure of the HTTP routes, a malformed body included, in the shape of the API whose path prefix it
    came through (`shapes`), else `default`'s."""

    def shape(request: Request) -> ErrorShape:
        return next((render for prefix, render in shapes.items() if request.url.path.startswith(prefix)), default)

    app.add_exception_handler(ApiError, lambda request, error: shape(request)(error))

    async def invalid_body(request: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return shape(request)(ApiError(400, f"invalid request: {first.get('msg', 'malformed body')}"
                                            f"{f' (at {where})' if where else ''}", param=where, code="bad_request"))

    app.add_exception_handler(RequestValidationError, invalid_body)
