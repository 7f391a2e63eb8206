"""The request and response bodies of the Anthropic Messages API (`/v1/messages`, `/v1/messages/count_tokens`), as
the official `anthropic` SDK sends and reads them. See docs/protocol.md for what is accepted and refused."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatd.api import tool_calling
from chatd.api.constants import FUNCTION_NAME
from chatd.api.tool_calling import RequestRefused
from sessions import Message, ToolCall

StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use", "refusal"]


class CacheControl(BaseModel):
    """A cache breakpoint: the prompt up to here is kept resident for `ttl` (five minutes, or an hour)."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["ephemeral"] = "ephemeral"
    ttl: Literal["5m", "1h"] = "5m"

    @property
    def seconds(self) -> float:
        return 3600.0 if self.ttl == "1h" else 300.0


class TextBlock(BaseModel):
    """Text in a message, the system prompt or a tool result."""

    model_config = ConfigDict(extra="ignore")  # citations and the like change nothing here
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(BaseModel):
    """A call the assistant made, in the history."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_use"]
    id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(BaseModel):
    """A tool's result, in a user message: text, or text blocks."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1, max_length=256)
    content: str | list[TextBlock] | None = None
    is_error: bool = False
    cache_control: CacheControl | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(b.text for b in self.content or ())
        return f"Error: {text}" if self.is_error else text


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(BaseModel):
    """One message of the conversation: a string, or content blocks."""

    model_config = ConfigDict(extra="ignore")
    role: Literal["user", "assistant", "system"]  # (system: a thread's tool additions or removals; refused)
    content: str | list[ContentBlock]

    def blocks(self) -> list[TextBlock | ToolUseBlock | ToolResultBlock]:
        return [TextBlock(type="text", text=self.content)] if isinstance(self.content, str) else list(self.content)

    def messages(self) -> list[Message]:
        """The message as a session holds it: a reply with its calls; a user's tool results (each a tool message),
        then its text."""
        blocks = self.blocks()
        text = "".join(block.text for block in blocks if isinstance(block, TextBlock))
        if self.role == "assistant":
            calls = tuple(ToolCall(b.id, b.name, json.dumps(b.input, ensure_ascii=False))
                          for b in blocks if isinstance(b, ToolUseBlock))
            return [Message("assistant", text, tool_calls=calls)]
        results = [Message("tool", b.text(), tool_call_id=b.tool_use_id) for b in blocks
                   if isinstance(b, ToolResultBlock)]
        return results + ([Message("user", text)] if text or not results else [])


class ToolParam(BaseModel):
    """A tool the reply may call."""

    model_config = ConfigDict(extra="ignore")
    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=16 * 1024)
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoiceAuto(BaseModel):
    """The model decides whether to call a tool."""

    type: Literal["auto"]
    disable_parallel_tool_use: bool = False


class ToolChoiceAny(BaseModel):
    """The model calls one of the tools (at least one)."""

    type: Literal["any"]
    disable_parallel_tool_use: bool = False


class ToolChoiceTool(BaseModel):
    """The model calls the named tool."""

    type: Literal["tool"]
    name: str
    disable_parallel_tool_use: bool = False


class ToolChoiceNone(BaseModel):
    """The model calls no tool."""

    type: Literal["none"]


ToolChoice = Annotated[ToolChoiceAuto | ToolChoiceAny | ToolChoiceTool | ToolChoiceNone, Field(discriminator="type")]


class OutputFormat(BaseModel):
    """`output_config.format`: the reply is JSON for this schema."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(BaseModel):
    """`output_config`: the reply's format (its effort and the like change nothing here)."""

    model_config = ConfigDict(extra="ignore")
    format: OutputFormat | None = None


class Metadata(BaseModel):
    """`metadata`: who the request is for."""

    model_config = ConfigDict(extra="ignore")
    user_id: str | None = Field(None, max_length=256)


class CountTokensRequest(BaseModel):
    """A conversation whose prompt tokens are counted, as `/v1/messages` would render it."""

    model_config = ConfigDict(extra="ignore")
    model: str
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[ToolParam] | None = Field(None, max_length=128)
    tool_choice: ToolChoice | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # the automatic breakpoint: on the last cacheable block
    thinking: dict[str, Any] | None = None

    def refuse_unsupported(self) -> None:
        """Raise `RequestRefused` for what chatd does not implement."""
        if self.thinking and self.thinking.get("type") not in (None, "disabled"):
            raise RequestRefused("thinking", "extended thinking is not supported by this server")
        if not self.threaded() and any(param.role == "system" for param in self.messages):
            raise RequestRefused("messages", "a system message in messages only adds or removes a thread's tools, "
                                             "which this server does not do; put the system prompt in system")
        if self.messages[-1].role != "user":
            raise RequestRefused("messages", "the last message must be the user's: a final assistant message "
                                             "(prefill) is not supported")

    def threaded(self) -> bool:
        """Whether the request runs on a thread (whose own refusals then answer a system message)."""
        return False

    def system_text(self) -> str | None:
        if isinstance(self.system, list):
            return "".join(block.text for block in self.system) or None
        return self.system or None

    def conversation(self) -> tuple[str | None, list[Message], list[Message]]:
        """(system prompt, the history, the turn's new messages: those after the last reply), the way a chatd
        session holds them."""
        messages = [message for param in self.messages for message in param.messages()]
        replies = [index for index, message in enumerate(messages) if message.role == "assistant"]
        new_from = replies[-1] + 1 if replies else len(messages) - 1
        return self.system_text(), messages[:new_from], messages[new_from:]

    def tool_setup(self, format: tool_calling.ToolFormat, earlier: list[Message] | None = None
                   ) -> tool_calling.ToolSetup:
        """The request's tools, tool choice and output format, checked (its tool results against the calls of its
        messages, or of the `earlier` history they continue); `RequestRefused` naming what is wrong."""
        tool_calling.check_tool_results([m for param in self.messages for m in param.messages()],
                                        earlier=earlier or [])
        response_schema = None
        if self.output_config is not None and self.output_config.format is not None:
            response_schema = tool_calling.checked_schema(self.output_config.format.schema_,
                                                          "output_config.format.schema")
        functions = [tool_calling.Function(t.name, t.description, t.input_schema) for t in self.tools or ()]
        choice, parallel = self.tool_choice or ToolChoiceAuto(type="auto"), True
        if not isinstance(choice, ToolChoiceNone):
            parallel = not choice.disable_parallel_tool_use
        named = {"auto": "auto", "any": "required", "none": "none"}.get(choice.type) or choice.name
        return tool_calling.tool_setup(format, functions, named, parallel, response_schema)

    def breakpoints(self) -> list[tuple[int, CacheControl]]:
        """The cache breakpoints (`cache_control` on tools, the system prompt or a message's block, or at the top
        level for the last block), each as the index of the message it ends (-1: the tools or the system prompt)
        and its control, in order."""
        marks: list[tuple[int, CacheControl]] = []
        system = self.system if isinstance(self.system, list) else []
        for control in [t.cache_control for t in self.tools or ()] + [b.cache_control for b in system]:
            if control is not None:
                marks.append((-1, control))
        for index, param in enumerate(self.messages):
            marks += [(index, block.cache_control) for block in param.blocks() if block.cache_control is not None]
        if self.cache_control is not None:
            marks.append((len(self.messages) - 1, self.cache_control))
        return marks


class ThreadCreate(BaseModel):
    """Hold this conversation with its reply under the reply's id (Anthropic's message threads)."""

    type: Literal["create"]


class ThreadContinue(BaseModel):
    """Continue from a held reply: `messages` holds only what is new; the system prompt and tools are the thread's."""

    type: Literal["continue"]
    previous_message_id: str = Field(min_length=1, max_length=256)


class MessagesRequest(CountTokensRequest):
    """`POST /v1/messages`. Unknown fields are ignored (clients add their own); fields that would change the
    meaning of the reply are refused by `refuse_unsupported`, not ignored."""

    max_tokens: int = Field(ge=1)  # (above the server's --max-new-tokens: the reply stops there, `max_tokens`)
    stop_sequences: list[Annotated[str, Field(min_length=1, max_length=256)]] | None = Field(None, max_length=16)
    temperature: float = Field(1.0, ge=0.0, le=1.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=1)
    metadata: Metadata | None = None
    stream: bool = False
    cache_salt: str | None = Field(None, max_length=256)  # chatd's (vLLM's) field: caches shared only within it
    session_id: str | None = Field(None, max_length=128)  # chatd's hint: continue this session
    thread: ThreadCreate | ThreadContinue | None = Field(None, discriminator="type")

    def threaded(self) -> bool:
        return self.thread is not None

    def new_messages(self) -> list[Message]:
        """Every message of the request, as a session holds them (a thread's continue sends only new ones)."""
        return [message for param in self.messages for message in param.messages()]

    def tool_definitions(self) -> list[dict] | None:
        """The tools as sent (what a thread keeps for the turns that continue it)."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools] if self.tools is not None else None


class TextOut(BaseModel):
    """A text block of the reply."""

    type: Literal["text"] = "text"
    text: str


class ToolUseOut(BaseModel):
    """A call in the reply."""

    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


class CacheCreation(BaseModel):
    """The newly written prompt tokens by the ttl of the breakpoint that covers them."""

    ephemeral_5m_input_tokens: int = 0
    ephemeral_1h_input_tokens: int = 0


class Usage(BaseModel):
    """A reply's tokens: the prompt's, split into those read from a cache, those newly written at a breakpoint
    and the rest (the three add up to the prompt's length), and the reply's."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_creation: CacheCreation = Field(default_factory=CacheCreation)


class MessageOut(BaseModel):
    """A reply of `/v1/messages`."""

    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[TextOut | ToolUseOut]
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class TokenCount(BaseModel):
    """The answer of `/v1/messages/count_tokens`."""

    input_tokens: int


class ErrorDetail(BaseModel):
    """An error in Anthropic's shape; `details.error_code` says which thread error it is."""

    type: str
    message: str
    details: dict[str, Any] | None = None


class ErrorOut(BaseModel):
    """The body of every failed Messages API request."""

    type: Literal["error"] = "error"
    error: ErrorDetail
