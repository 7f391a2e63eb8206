"""The websocket protocol: JSON text frames, each with a `type`. See docs/protocol.md. Its `error` frame is every
API's refusal of a turn (`chatd.api.turn_errors`)."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, model_validator

from chatd.api.constants import FUNCTION_NAME, MAX_NEW_TOKENS_CAP
from chatd.api.turn_errors import ErrorMessage


class _Message(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ChatParams(_Message):
    """Sampling parameters of a `chat.request`."""

    max_new_tokens: int = Field(256, ge=1, le=MAX_NEW_TOKENS_CAP)
    temperature: float = Field(0.0, ge=0.0, le=5.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**64)  # what torch.Generator takes
    stop: list[Annotated[str, Field(min_length=1, max_length=256)]] = Field(default_factory=list, max_length=16)


class Auth(_Message):
    """The first message of a connection when the server requires an API key (browsers cannot set
    an Authorization header on a websocket)."""

    type: Literal["auth"]
    token: str = Field(max_length=4096)


class ToolSpec(_Message):
    """A function the model may call: its name, what it does, and the JSON Schema of its arguments."""

    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=16 * 1024)
    parameters: dict[str, Any] | None = None


class NamedTool(_Message):
    """`tool_choice` naming the one function the reply must call."""

    name: str


class ReplyFormat(_Message):
    """What a reply must be: free text, any JSON object, or JSON for `schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    type: Literal["text", "json_object", "json_schema"] = "text"
    schema_: dict[str, Any] | None = Field(None, alias="schema")


class ToolFields(_Message):
    """Tools and a reply format: on `session.open` for every turn of the session, on `chat.request` for that
    turn (each field given replaces the session's)."""

    tools: list[ToolSpec] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    response_format: ReplyFormat | None = None

    def tool_options(self) -> dict:
        """The fields given, as JSON (what a session keeps)."""
        return self.model_dump(include=set(ToolFields.model_fields), exclude_none=True, by_alias=True)


class SessionOpen(ToolFields):
    """Open a new session, or resume one by id."""

    type: Literal["session.open"]
    session_id: str | None = None
    system: str | None = None


class ToolResult(_Message):
    """What a function returned, for the call `call_id` of the session's last reply."""

    call_id: str = Field(min_length=1, max_length=256)
    content: str


class ChatRequest(ToolFields):
    """One user message, or the results of the calls the last reply made, for a session: starts a turn."""

    type: Literal["chat.request"]
    session_id: str
    turn_id: str | None = Field(None, min_length=1, max_length=128)
    content: str | None = Field(None, min_length=1)
    tool_results: list[ToolResult] | None = Field(None, min_length=1, max_length=128)
    params: ChatParams = Field(default_factory=ChatParams)

    @model_validator(mode="after")
    def _content_or_results(self) -> ChatRequest:
        if (self.content is None) == (self.tool_results is None):
            raise ValueError("give content (the user's message) or tool_results, one of them")
        return self


class ChatCancel(_Message):
    """Stop a running turn; its `chat.done` says `cancelled`."""

    type: Literal["chat.cancel"]
    turn_id: str


class ChatResume(_Message):
    """After a reconnect: replay a turn's events after `last_seq`, then stream the rest."""

    type: Literal["chat.resume"]
    turn_id: str = Field(min_length=1, max_length=128)
    last_seq: int = Field(-1, ge=-1)


class Typing(_Message):
    """The user is typing: a hint to bring the session's cache back to the device."""

    type: Literal["typing"]
    session_id: str


class SessionClose(_Message):
    """Delete a session and its cache."""

    type: Literal["session.close"]
    session_id: str


ClientMessage = Annotated[Auth | SessionOpen | ChatRequest | ChatCancel | ChatResume | Typing | SessionClose,
                          Field(discriminator="type")]
_client_message = TypeAdapter(ClientMessage)


class ProtocolError(ValueError):
    """A frame that is not a valid client message; the text names the problem."""


def parse_client_message(frame: str | bytes
                         ) -> Auth | SessionOpen | ChatRequest | ChatCancel | ChatResume | Typing | SessionClose:
    """A client frame as its model, or `ProtocolError` naming what is wrong."""
    if isinstance(frame, bytes):
        raise ProtocolError("binary frames are not supported: send JSON text frames")
    try:
        data = json.loads(frame)
    except ValueError as error:  # malformed, or an integer longer than Python converts
        raise ProtocolError(f"invalid JSON: {error}") from None
    except RecursionError:
        raise ProtocolError("invalid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise ProtocolError("a message must be a JSON object with a 'type'")
    if _SURROGATE_ESCAPE.search(frame) and (where := _lone_surrogate(data)) is not None:
        raise ProtocolError(f"{where}: a lone surrogate escape (\\ud800 to \\udfff without its pair) is not text")
    try:
        return _client_message.validate_python(data)
    except ValidationError as error:
        problems = []
        for problem in error.errors(include_url=False):
            where = ".".join(str(part) for part in problem["loc"])
            problems.append(f"{where}: {problem['msg']}" if where else problem["msg"])
        raise ProtocolError("; ".join(problems)) from None


# Text frames arrive as valid UTF-8; only a JSON escape can put a surrogate into a parsed string.
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(data: dict) -> str | None:
    """The field whose text holds a lone surrogate (JSON's "\\ud800" parses to one), or None. Such text
    cannot be encoded as UTF-8, so the tokenizer, Redis and the reply would each fail on it later."""
    pending: list[tuple[str, object]] = [("", data)]
    while pending:  # iterative: a message may nest as deeply as the JSON parser allows
        where, value = pending.pop()
        if isinstance(value, str):
            if _SURROGATE.search(value):
                return where
        elif isinstance(value, dict | list):
            for key, item in value.items() if isinstance(value, dict) else enumerate(value):
                if _SURROGATE.search(str(key)):
                    return f"a key of {where or 'the message'}"
                pending.append((f"{where}.{key}" if where else str(key), item))
    return None


class ToolCallOut(BaseModel):
    """A call a reply makes: its id (for the result), the function and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


class HistoryMessage(BaseModel):
    """One completed message of a session, as `session.ready` lists them."""

    role: Literal["user", "assistant", "tool"]
    content: str
    tool_calls: list[ToolCallOut] = Field(default_factory=list)  # a reply's calls
    tool_call_id: str | None = None  # a tool result: the call it answers


class AuthOk(BaseModel):
    """The key was accepted."""

    type: Literal["auth.ok"] = "auth.ok"


class SessionReady(BaseModel):
    """The session is open: its id, turns so far and history."""

    type: Literal["session.ready"] = "session.ready"
    session_id: str
    turns: int
    resumed: bool
    worker: str  # which chatd process serves the session (host:pid), for routing and debugging
    history: list[HistoryMessage] = Field(default_factory=list)  # the completed turns, so a UI can redraw them


class Delta(BaseModel):
    """A piece of reply text."""

    content: str


class ChatDelta(BaseModel):
    """A streamed piece of a turn's reply, numbered for `chat.resume`."""

    type: Literal["chat.delta"] = "chat.delta"
    turn_id: str
    seq: int
    delta: Delta


class Usage(BaseModel):
    """A turn's token counts: prompt, completion, and prompt tokens reused from a cache."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int


class Timings(BaseModel):
    """Where a turn's time went, in milliseconds."""

    queue_ms: float
    ttft_ms: float
    prefill_ms: float
    decode_ms: float
    total_ms: float
    tokens_per_s: float


class SpeculationReport(BaseModel):
    """The turn's speculative decoding: draft tokens verified, and those the model sampled too (each saved a decode
    step; the reply is what plain decoding gives)."""

    draft_tokens: int = 0
    accepted_tokens: int = 0


class RemoteReport(BaseModel):
    """Why a cache found in the remote tier was fetched or not: the two estimates compared; `timeout`: Redis did not
    answer within the time recomputing was estimated to take, and the turn recomputed instead of waiting longer."""

    choice: Literal["fetch", "recompute", "timeout"]
    fetch_ms: float | None
    prefill_ms: float | None
    waited_ms: float | None = None  # how long the turn waited for Redis (the batch decoded on meanwhile)


class CacheReport(BaseModel):
    """Where a turn's cache came from, or why there was none."""

    source: Literal["device", "host", "remote", "prefix", "miss"]
    miss_reason: Literal["new", "cold", "evicted", "disabled", "drift", "corrupt", "stale", "truncated"] | None = None
    cleared: list[str] = Field(default_factory=list)
    remote: RemoteReport | None = None
    quantized: Literal["int8"] | None = None  # the reused cache came from an int8 copy (host or Redis tier)


class ChatDone(BaseModel):
    """A turn's end: the whole reply (its prose, and its calls), why it ended, usage, timings and the cache
    report. `grammar_error`: the model could not go on within the tools' or the format's grammar."""

    type: Literal["chat.done"] = "chat.done"
    turn_id: str
    finish_reason: Literal["stop", "length", "cancelled", "tool_calls", "grammar_error"]
    content: str
    tool_calls: list[ToolCallOut] = Field(default_factory=list)
    usage: Usage
    timings: Timings
    cache: CacheReport
    dropped_turns: int = 0  # oldest turns left out of the prompt so that it fits the model's context
    speculation: SpeculationReport = Field(default_factory=SpeculationReport)


class SessionClosed(BaseModel):
    """The session was deleted."""

    type: Literal["session.closed"] = "session.closed"
    session_id: str


ServerMessage = Annotated[AuthOk | SessionReady | ChatDelta | ChatDone | SessionClosed | ErrorMessage,
                          Field(discriminator="type")]
_server_message = TypeAdapter(ServerMessage)


def parse_server_message(frame: str | bytes
                         ) -> AuthOk | SessionReady | ChatDelta | ChatDone | SessionClosed | ErrorMessage:
    """A server frame as its model (for clients); raises pydantic's `ValidationError` for anything else."""
    return _server_message.validate_json(frame)


def json_schemas() -> dict[str, dict]:
    """The websocket protocol as JSON Schema: every message a client may send, and the server may answer."""
    return {"client_to_server": _client_message.json_schema(), "server_to_client": _server_message.json_schema()}
