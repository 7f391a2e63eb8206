"""A failed HTTP API request, whatever API it came through: its status, message, the parameter at fault, chatd's
error code. Each API writes it in its own shape (OpenAI's `{"error": {...}}`, Anthropic's `{"type": "error", ...}`):
the server installs one handler that picks the shape by the route's path."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import PlainTextResponse, Response

from chatd.api.tool_calling import RequestRefused
from chatd.api.turn_errors import ErrorMessage
from chatd.engine.turn import TurnFailed
from sessions import StoreUnavailable

T = TypeVar("T")
log = logging.getLogger(__name__)

# chatd's error codes (websocket protocol and engine) as HTTP statuses.
_STATUS = {"bad_request": 400, "limit_exceeded": 400, "too_long": 400, "context_length_exceeded": 400,
           "unauthorized": 401, "unknown_session": 404,
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

    def refused(request: Request, error: ApiError) -> Response:
        """The refusal in the API's shape, logged once (its route, status and code: an operator sees why clients
        fail without turning on debug logs)."""
        log.info("%s %s refused: %d %s: %s", request.method, request.url.path, error.status, error.code,
                 error.message)
        return next((render for prefix, render in shapes.items() if request.url.path.startswith(prefix)),
                    default)(error)

    app.add_exception_handler(ApiError, refused)

    async def invalid_body(request: Request, error: RequestValidationError) -> Response:
        message, where = _first_problem(error.errors(), error.body)
        return refused(request, ApiError(400, f"invalid request: {message}{f' (at {where})' if where else ''}",
                                         param=where, code="bad_request"))

    app.add_exception_handler(RequestValidationError, invalid_body)

    async def no_route(request: Request, error: StarletteHTTPException) -> Response:
        """An unknown path or a method a path does not take: in the API's shape under /v1 (clients parse it), as
        text naming what is served elsewhere."""
        if not request.url.path.startswith("/v1/"):
            if error.status_code != 404:
                return PlainTextResponse(f"{error.detail}\n", error.status_code, getattr(error, "headers", None))
            served = sorted({"/ws", *(path for path in request.app.openapi()["paths"] if "{" not in path)})
            return PlainTextResponse(f"not found: chatd serves {', '.join(served)}\n", 404)
        if error.status_code == 405:
            allowed = error.headers.get("Allow", "") if error.headers else ""
            return refused(request, ApiError(405, f"{request.method} is not allowed on {request.url.path}"
                                                  f"{f' (it takes {allowed})' if allowed else ''}",
                                             code="method_not_allowed"))
        return refused(request, ApiError(error.status_code, f"no route {request.method} {request.url.path}"
                                         if error.status_code == 404 else str(error.detail),
                                         code="not_found" if error.status_code == 404 else None))

    app.add_exception_handler(StarletteHTTPException, no_route)


def _first_problem(errors: Sequence[dict], body: Any) -> tuple[str, str | None]:
    """The validation error to tell the client, and where in its body, named as the client wrote it (`input[2].content`,
    `tool_choice`): pydantic's locations also name the union branches it tried (`str`, `literal['none','auto']`,
    a model's name), which are not in the body. Of a union's branches, the one that got furthest into the body."""
    best: tuple[int, str, str | None] = (-1, "malformed body", None)
    for problem in errors:
        path = _sent_path(problem.get("loc", ())[1:], body, problem.get("type") == "missing")
        if len(path) > best[0]:
            where = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")
            best = (len(path), problem.get("msg", "malformed body"), where or None)
    return best[1], best[2]


def _sent_path(location: Sequence[Any], body: Any, missing: bool) -> list[str | int]:
    """The parts of `location` that name something in `body` (and, for a `missing` field, its name, the last)."""
    path: list[str | int] = []
    node = body
    for index, part in enumerate(location):
        named = isinstance(part, str) and (part in node or missing and index == len(location) - 1) \
            if isinstance(node, dict) else False
        if named:
            path.append(part)
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
    return path
