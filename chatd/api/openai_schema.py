"""The request and response bodies of the OpenAI-compatible API (chat completions and models), as
OpenAI's own clients send and read them. See docs/protocol.md for what is accepted and refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatd.api.protocol import MAX_NEW_TOKENS_CAP
from sessions import Message


class RequestRefused(ValueError):
    """A request chatd does not serve as asked: 400, naming the parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


class TextPart(BaseModel):
    """A text part of a message's content array."""

    type: Literal["text"]
    text: str


class ChatMessageIn(BaseModel):
    """One message of a chat completions request."""

    model_config = ConfigDict(extra="ignore")  # `name` and the like change nothing here

    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class StreamOptions(BaseModel):
    """`stream_options`: whether a last chunk carries the usage."""

    include_usage: bool = False


class ResponseFormat(BaseModel):
    """`response_format`: only `text` is served."""

    model_config = ConfigDict(extra="allow")
    type: str = "text"


class ChatCompletionRequest(BaseModel):
    """Unknown fields are ignored (clients add their own); fields that would change the meaning of
    the reply are refused by `refuse_unsupported`, not ignored."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[ChatMessageIn] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[Annotated[str, Field(min_length=1, max_length=256)]] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    session_id: str | None = Field(None, max_length=128)  # chatd's hint: continue this session
    prompt_cache_key: str | None = Field(None, max_length=128)  # OpenAI's name for the same hint
    # Accepted at their neutral values only.
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: ResponseFormat | None = None

    @field_validator("stop")
    @classmethod
    def _at_most_four(cls, stop: str | list[str] | None) -> str | list[str] | None:
        if isinstance(stop, list) and len(stop) > 4:
            raise ValueError("at most 4 stop sequences")
        return stop

    def refuse_unsupported(self) -> None:
        """Raise `RequestRefused` for a parameter whose meaning chatd does not implement."""
        if self.n != 1:
            raise RequestRefused("n", "n must be 1: chatd returns one choice per request")
        for name in ("tools", "functions"):
            if getattr(self, name):
                raise RequestRefused(name, f"{name} (function calling) is not supported")
        for name in ("tool_choice", "function_call"):
            if getattr(self, name) not in (None, "none"):
                raise RequestRefused(name, f"{name} is not supported")
        if self.logprobs or self.top_logprobs:
            raise RequestRefused("logprobs", "logprobs are not supported")
        if self.response_format is not None and self.response_format.type != "text":
            raise RequestRefused("response_format", "only response_format type 'text' is supported")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                raise RequestRefused(name, f"{name} other than 0 is not supported")
        if self.logit_bias:
            raise RequestRefused("logit_bias", "logit_bias is not supported")
        if self.messages[-1].role != "user":
            raise RequestRefused("messages", "the last message must be the user's: chatd answers it")
        if (self.max_completion_tokens or self.max_tokens or 0) > MAX_NEW_TOKENS_CAP:
            raise RequestRefused("max_tokens", f"max_tokens is at most {MAX_NEW_TOKENS_CAP}")

    def conversation(self) -> tuple[str | None, list[Message], str]:
        """(system prompt, the history before the last message, the last user message), the way a
        chatd session holds them."""
        messages = [Message("system" if m.role == "developer" else m.role, m.text()) for m in self.messages]
        system = messages[0].content if messages[0].role == "system" and len(messages) > 1 else None
        history = messages[1 if system is not None else 0:-1]
        return system, history, messages[-1].content

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionTokensDetails(BaseModel):
    """`prompt_tokens_details`: the prompt tokens reused from a cache."""

    cached_tokens: int = 0


class CompletionUsage(BaseModel):
    """A completion's token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CompletionTokensDetails


class AssistantMessage(BaseModel):
    """The reply of a non-streamed completion."""

    role: Literal["assistant"] = "assistant"
    content: str


class Choice(BaseModel):
    """The one choice of a non-streamed completion."""

    index: int = 0
    message: AssistantMessage
    finish_reason: Literal["stop", "length"]
    logprobs: None = None


class ChatCompletion(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage


class ChunkDelta(BaseModel):
    """What one streamed chunk adds: the role first, then text."""

    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    """The one choice of a streamed chunk."""

    index: int = 0
    delta: ChunkDelta
    finish_reason: Literal["stop", "length"] | None = None
    logprobs: None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: CompletionUsage | None = None


class ModelCard(BaseModel):
    """A served model, as `/v1/models` lists it."""

    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "chatd"


class ModelList(BaseModel):
    """The body of `GET /v1/models`."""

    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(BaseModel):
    """An error in OpenAI's shape."""

    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    """The body of every failed OpenAI API request."""

    error: ErrorBody
