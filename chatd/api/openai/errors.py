"""OpenAI's error shape for every failure of the OpenAI routes (chat completions, Responses, Conversations)."""

from __future__ import annotations

import math

from starlette.responses import JSONResponse, Response

from chatd.api.http_errors import ApiError
from chatd.api.openai.chat_schema import ErrorBody, ErrorResponse

_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
         405: "invalid_request_error", 409: "conflict_error", 429: "rate_limit_error", 500: "server_error",
         503: "service_unavailable"}


def openai_body(error: ApiError) -> ErrorResponse:
    """The error body OpenAI's clients parse."""
    return ErrorResponse(error=ErrorBody(message=error.message, type=_TYPE.get(error.status, "server_error"),
                                         param=error.param, code=error.code))


def openai_response(error: ApiError) -> Response:
    """A failed request of the OpenAI routes: OpenAI's body and status, with `Retry-After` where it helps."""
    headers = {"Retry-After": str(math.ceil(error.retry_after_s))} if error.retry_after_s is not None else None
    return JSONResponse(openai_body(error).model_dump(), error.status, headers)
