"""Anthropic's error shape (`{"type": "error", "error": {"type": ..., "message": ...}}`) and the statuses the
`anthropic` SDK maps to its exception classes: 400, 401, 403, 404, 409, 413, 429, 500 and 529 (overloaded: a
busy, loading or draining server, which the SDK retries)."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse, Response

from chatd.api.anthropic.messages_schema import ErrorDetail, ErrorOut
from chatd.api.http_errors import ApiError

OVERLOADED = 529
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "invalid_request_error", 413: "request_too_large", 429: "rate_limit_error",
         500: "api_error", OVERLOADED: "overloaded_error"}


def anthropic_status(error: ApiError) -> int:
    """The status the SDK maps: an unavailable or busy server is overloaded (529), as Anthropic's own."""
    return OVERLOADED if error.status == 503 else error.status


def anthropic_body(error: ApiError) -> ErrorOut:
    """The error body the SDK parses (also an `error` event of a stream that already began)."""
    return ErrorOut(error=ErrorDetail(type=_TYPE.get(anthropic_status(error), "api_error"), message=error.message,
                                      details=error.details))


def anthropic_response(error: ApiError) -> Response:
    """A failed request of the Messages routes: Anthropic's body and status, with `retry-after` where it helps."""
    headers = {"retry-after": str(math.ceil(error.retry_after_s))} if error.retry_after_s is not None else None
    return JSONResponse(anthropic_body(error).model_dump(exclude_none=True), anthropic_status(error), headers)
