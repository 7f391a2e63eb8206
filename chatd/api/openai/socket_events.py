"""What a Responses WebSocket reads and writes besides a response's own events: the `response.create` envelope (its
lane), the error envelope, steering input and the steering events. Plain values and checks, no I/O."""

from __future__ import annotations

import re
import secrets
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from chatd.api.http_errors import ApiError
from chatd.api.openai.errors import openai_body
from chatd.api.openai.input_items import InputMessage
from chatd.api.openai.responses_schema import OutputFunctionCall, ResponseRequest

STREAM_ID = re.compile(r"[A-Za-z0-9_.-]{1,256}")


class SocketCreate(ResponseRequest):
    """A `response.create` event: the `POST /v1/responses` body, flat, plus its lane. `stream` is ignored (clients
    such as Codex always send it)."""

    model_config = ConfigDict(extra="ignore")

    type: str = "response.create"
    stream_id: str | None = None


class SocketError(Exception):
    """A refusal before a response exists, sent as an `error` event (the socket stays open)."""

    def __init__(self, status: int, code: str, message: str, param: str | None = None, lane: str | None = None):
        super().__init__(message)
        self.status, self.code, self.message, self.param, self.lane = status, code, message, param, lane

    @classmethod
    def of(cls, error: ApiError, lane: str | None) -> SocketError:
        return cls(error.status, error.code or "server_error", error.message, error.param, lane)

    def event(self) -> dict:
        """The WebSocket error envelope: `{"type": "error", "status", "stream_id"?, "error": {...}}`."""
        body = openai_body(ApiError(self.status, self.message, self.param, self.code)).error.model_dump()
        return with_lane({"type": "error", "status": self.status, "error": body}, self.lane)


def with_lane(event: dict, lane: str | None) -> dict:
    """A named lane's events carry its `stream_id`; the default lane's carry none."""
    return {**event, "stream_id": lane} if lane is not None else event


def parse_create(event: dict[str, Any]) -> SocketCreate:
    """A `response.create` event, checked; a `SocketError` naming what is wrong (with its lane, when it has a valid
    one)."""
    lane = event.get("stream_id")
    if lane is not None and (not isinstance(lane, str) or not STREAM_ID.fullmatch(lane)):
        raise SocketError(400, "invalid_stream_id", "stream_id must be 1 to 256 characters of letters, digits, "
                                                    "'_', '.' and '-'", param="stream_id")
    try:
        return SocketCreate.model_validate(event)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or None
        raise SocketError(400, "invalid_request_error", f"invalid response.create: {first['msg']}"
                                                        f"{f' (at {where})' if where else ''}", where, lane) from None


class SteerInput(BaseModel):
    """One steering message: user text only (`type`, `role`, `content`, nothing else)."""

    model_config = ConfigDict(extra="forbid")

    type: str = "message"
    role: str
    content: Any


def steer_messages(value: Any) -> list[InputMessage] | None:
    """Steering input as the user messages it adds, or None when it is not user text (a string, or a non-empty list
    of user messages whose content is a string or `input_text` parts)."""
    if isinstance(value, str):
        return [InputMessage(role="user", content=value)] if value else None
    if not isinstance(value, list) or not value:
        return None
    messages = []
    for item in value:
        try:
            steer = SteerInput.model_validate(item)
            message = InputMessage.model_validate({"role": steer.role, "content": steer.content})
        except ValidationError:
            return None
        text_parts = isinstance(message.content, str) or all(part.type == "input_text" for part in message.content)
        if steer.type != "message" or steer.role != "user" or not text_parts:
            return None
        messages.append(message)
    return messages


def steer_id() -> str:
    """A new steering submission's id, as `response.steer.accepted` gives it."""
    return "steer_" + secrets.token_hex(12)


def steer_event(kind: str, sequence: int, steer: dict, lane: str | None, **fields) -> dict:
    """`response.steer.accepted`, `.pending` or `.failed`."""
    return with_lane({"type": f"response.steer.{kind}", "sequence_number": sequence, "steer": steer, **fields}, lane)


def steer_failed(sequence: int, code: str, message: str, previous_response_id: str, value: Any,
                 lane: str | None, steer: str | None = None) -> dict:
    """A steer that cannot be (or was not) committed, its input returned."""
    returned = {"input": value, "previous_response_id": previous_response_id, **({"id": steer} if steer else {})}
    return steer_event("failed", sequence, returned, lane,
                       error={"type": "invalid_request_error", "code": code, "message": message})


def required_input(calls: list[OutputFunctionCall]) -> list[dict]:
    """The stubs a client fills with its tools' results, one per call the response made."""
    return [{"type": "function_call_output", "call_id": call.call_id, "name": call.name} for call in calls]
