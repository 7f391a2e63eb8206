"""The bodies of OpenAI's Responses API (`/v1/responses`) and Conversations API (`/v1/conversations`) as
chatd serves them: text in, text out, state kept as chatd sessions. See docs/protocol.md for what is
accepted and refused."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatd.api.openai.chat_schema import RequestRefused
from chatd.api.protocol import MAX_NEW_TOKENS_CAP
from sessions import Message


class InputText(BaseModel):
    """A text part of an input message (`input_text`; `output_text` for an assistant's earlier reply)."""

    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    """One message item of `input` (or of a conversation's `items`)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[InputText]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)

    def message(self) -> Message:
        return Message("system" if self.role == "developer" else self.role, self.text())


class ResponseRequest(BaseModel):
    """Unknown fields are ignored; fields that would change the meaning of the reply are refused by
    `refuse_unsupported`, naming the parameter."""

    model_config = ConfigDict(extra="ignore")

    model: str
    input: str | list[InputMessage]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    previous_response_id: str | None = Field(None, max_length=128)
    conversation: str | dict[str, str] | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = Field(None, max_length=256)
    # Accepted only where they change nothing.
    tools: list[Any] | None = None
    tool_choice: Any = None
    reasoning: Any = None
    background: bool | None = None
    include: list[str] | None = None
    text: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    def refuse_unsupported(self) -> None:
        """Raise `RequestRefused` for a parameter whose meaning chatd does not implement."""
        if self.tools:
            raise RequestRefused("tools", "tools (function calling, built-in tools) are not supported")
        if self.tool_choice not in (None, "none", "auto"):
            raise RequestRefused("tool_choice", "tool_choice is not supported")
        if self.reasoning is not None:
            raise RequestRefused("reasoning", "reasoning is not supported: the served model does not reason")
        if self.background:
            raise RequestRefused("background", "background responses are not supported")
        for item in self.include or []:
            raise RequestRefused("include", f"include {item!r} is not supported")
        format_type = ((self.text or {}).get("format") or {}).get("type", "text")
        if format_type != "text":
            raise RequestRefused("text.format", "only text.format type 'text' is supported")
        if (self.max_output_tokens or 0) > MAX_NEW_TOKENS_CAP:
            raise RequestRefused("max_output_tokens", f"max_output_tokens is at most {MAX_NEW_TOKENS_CAP}")
        if self.previous_response_id and self.conversation:
            raise RequestRefused("conversation", "give previous_response_id or conversation, not both")
        if not self.messages() or self.messages()[-1].role != "user":
            raise RequestRefused("input", "the last input item must be the user's message: chatd answers it")

    def messages(self) -> list[Message]:
        """`input` as messages."""
        if isinstance(self.input, str):
            return [Message("user", self.input)]
        return [item.message() for item in self.input]

    def conversation_id(self) -> str | None:
        if isinstance(self.conversation, dict):
            return self.conversation.get("id")
        return self.conversation


class OutputText(BaseModel):
    """The text part of the reply's message item."""

    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)


class OutputMessage(BaseModel):
    """The assistant's reply as an output item."""

    id: str
    type: Literal["message"] = "message"
    status: Literal["in_progress", "completed", "incomplete"]
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class InputTokensDetails(BaseModel):
    """The input tokens a cache covered."""

    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    """Always zero reasoning tokens: the served models do not reason apart."""

    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    """A response's token counts, as OpenAI names them."""

    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class IncompleteDetails(BaseModel):
    """Why a response is incomplete: its reply reached max_output_tokens."""

    reason: Literal["max_output_tokens"] = "max_output_tokens"


class ResponseError(BaseModel):
    """Why a response failed (chatd's error code and message)."""

    code: str
    message: str


class ConversationRef(BaseModel):
    """The conversation a response belongs to."""

    id: str


class ResponseObject(BaseModel):
    """A response, as created, streamed and retrieved."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete", "failed"]
    model: str
    output: list[OutputMessage] = Field(default_factory=list)
    usage: ResponseUsage | None = None
    instructions: str | None = None
    previous_response_id: str | None = None
    conversation: ConversationRef | None = None
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    store: bool = True
    temperature: float = 1.0
    top_p: float = 1.0
    max_output_tokens: int | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    tools: list[Any] = Field(default_factory=list)
    tool_choice: str = "none"
    parallel_tool_calls: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})


class ResponseDeleted(BaseModel):
    """The body of DELETE /v1/responses/{id}."""

    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True


class InputItem(BaseModel):
    """An input item as `GET /v1/responses/{id}/input_items` and conversation items list it."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    status: Literal["completed"] = "completed"
    content: list[dict[str, Any]]


class ItemList(BaseModel):
    """A page of items (all of them: chatd does not paginate)."""

    object: Literal["list"] = "list"
    data: list[InputItem]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ConversationCreate(BaseModel):
    """The body of POST /v1/conversations."""

    model_config = ConfigDict(extra="ignore")

    items: list[InputMessage] | None = Field(None, max_length=1000)
    metadata: dict[str, str] | None = Field(None, max_length=16)


class ConversationObject(BaseModel):
    """A conversation, as created and retrieved."""

    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)


class ConversationDeleted(BaseModel):
    """The body of DELETE /v1/conversations/{id}."""

    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True
