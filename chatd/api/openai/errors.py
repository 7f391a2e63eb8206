"""OpenAI's error shape for every failure of the OpenAI routes (chat completions, Responses, Conversations)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response

from chatd.api.openai.chat_schema import ErrorBody, ErrorResponse
from chatd.api.protocol import ErrorMessage
from chatd.api.tool_calling import RequestRefused
from chatd.engine.turn import TurnFailed

# chatd's error codes (websocket protocol and engine) as HTTP statuses and OpenAI error types.
_STATUS = {"bad_request": 400, "limit_exceeded": 400, "too_long": 400, "unauthorized": 401, "unknown_session": 404,
           "rate_limited": 429, "conflict": 409, "busy": 503, "unavailable": 503, "internal": 500}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A failed OpenAI API request: its status, and the error body OpenAI's clients parse."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, error: ErrorMessage | TurnFailed) -> ApiError:
        return cls(_STATUS.get(error.code, 500), error.message, code=error.code,
                   retry_after_s=getattr(error, "retry_after_s", None))

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=_TYPE.get(self.status, "server_error"),
                                             param=self.param, code=self.code))

    def response(self) -> Response:
        headers = {"Retry-After": str(math.ceil(self.retry_after_s))} if self.retry_after_s is not None else None
        return JSONResponse(self.body().model_dump(), self.status, headers)


@contextlib.contextmanager
def refusals() -> Iterator[None]:
    """A `RequestRefused` as OpenAI's 400, naming the parameter."""
    try:
        yield
    except RequestRefused as error:
        raise ApiError(400, str(error), param=error.param, code="bad_request") from None


def install_error_handlers(app) -> None:
    """OpenAI's error shape for every failure of these routes, a malformed body included."""
    app.add_exception_handler(ApiError, lambda request, error: error.response())

    async def invalid_body(request: Request, error: RequestValidationError) -> Response:
        first = error.errors()[0] if error.errors() else {}
        where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
        return ApiError(400, f"invalid request: {first.get('msg', 'malformed body')}"
                             f"{f' (at {where})' if where else ''}", param=where, code="bad_request").response()

    app.add_exception_handler(RequestValidationError, invalid_body)
