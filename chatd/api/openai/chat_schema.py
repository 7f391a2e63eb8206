"""The request and response bodies of the OpenAI-compatible API (chat completions and models), as
OpenAI's own clients send and read them. See docs/protocol.md for what is accepted and refused."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from chatd.api.constants import FUNCTION_NAME
from chatd.api.openai.prompt_cache import PromptCacheBreakpoint, PromptCacheControls
from chatd.api.openai.request_body import RequestBody
from chatd.api.tool_calling import (
    Function,
    RequestRefused,
    ToolFormat,
    ToolSetup,
    check_tool_results,
    checked_schema,
    tool_setup,
)
from sessions import Message, ToolCall

FinishReason = Literal["stop", "length", "tool_calls", "grammar_error"]


class TextPart(BaseModel):
    """A text part of a message's content array."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class FunctionCallIn(BaseModel):
    """The function and arguments of a call in an assistant message."""

    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(max_length=256 * 1024)


class ToolCallIn(BaseModel):
    """A call in an assistant message of the history."""

    model_config = ConfigDict(extra="ignore")
    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessageIn(BaseModel):
    """One message of a chat completions request."""

    model_config = ConfigDict(extra="ignore")  # `name` and the like change nothing here

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = Field(None, max_length=256)

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""

    def message(self) -> Message:
        """The message as a session holds it."""
        calls = tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in self.tool_calls or ())
        return Message("system" if self.role == "developer" else self.role, self.text(), tool_calls=calls,
                       tool_call_id=self.tool_call_id if self.role == "tool" else None)


class FunctionDefinition(BaseModel):
    """A function a reply may call."""

    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=16 * 1024)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDefinition(BaseModel):
    """A tool of the request: a function."""

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    """The function `tool_choice` names."""

    name: str


class NamedToolChoice(BaseModel):
    """`tool_choice` naming one function."""

    type: Literal["function"]
    function: NamedFunction


class AllowedFunction(BaseModel):
    """A tool `allowed_tools` lets the model call."""

    type: Literal["function"]
    function: NamedFunction


class AllowedTools(BaseModel):
    """`allowed_tools`: the listed tools the model may call, `auto` (or answer) or `required`."""

    mode: Literal["auto", "required"]
    tools: list[AllowedFunction] = Field(max_length=128)


class AllowedToolsChoice(BaseModel):
    """`tool_choice` restricting the reply to some of the tools (all of them stay in the prompt)."""

    type: Literal["allowed_tools"]
    allowed_tools: AllowedTools


class JsonSchemaFormat(BaseModel):
    """`response_format.json_schema`: the schema the reply must follow."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class StreamOptions(BaseModel):
    """`stream_options`: whether a last chunk carries the usage."""

    include_usage: bool = False


class ResponseFormat(BaseModel):
    """`response_format`: free text, any JSON object, or JSON for a schema."""

    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class ChatCompletionRequest(RequestBody, PromptCacheControls):
    """Unknown fields are ignored (clients add their own); fields that would change the meaning of
    the reply are refused by `refuse_unsupported`, not ignored."""

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
    prompt_cache_key: str | None = Field(None, max_length=128)  # OpenAI's: one key's requests try its last session
    cache_salt: str | None = Field(None, max_length=256)  # vLLM's field: caches shared only among the same salt
    # vLLM's sampling extensions (benchmark clients fix reply lengths with them)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    # Accepted at their neutral values only.
    n: int = 1
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | AllowedToolsChoice | None = None
    parallel_tool_calls: bool = True
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
        if self.functions or self.function_call not in (None, "none"):
            raise RequestRefused("functions", "functions and function_call are deprecated: send tools and tool_choice")
        if self.logprobs or self.top_logprobs:
            raise RequestRefused("logprobs", "logprobs are not supported")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) != 0:
                raise RequestRefused(name, f"{name} other than 0 is not supported")
        if self.logit_bias:
            raise RequestRefused("logit_bias", "logit_bias is not supported")
        if self.min_tokens > (self.max_completion_tokens or self.max_tokens or self.min_tokens):
            raise RequestRefused("min_tokens", "min_tokens is more than max_tokens")
        if self.messages[-1].role not in ("user", "tool"):
            raise RequestRefused("messages", "the last message must be the user's or a tool's result: chatd answers it")
        if self.prompt_cache_options is not None and self.prompt_cache_options.comparison_response_id is not None:
            raise RequestRefused("prompt_cache_options.comparison_response_id", "prompt cache diagnostics compare "
                                 "with a stored response: ask the Responses API")
        if self.prompt_cache_options is not None and self.prompt_cache_options.prewarm:
            raise RequestRefused("prompt_cache_options.prewarm", "a chat completion always answers: prewarm with "
                                                                 "the Responses API")
        self.keep_for_s()  # (refuses a ttl given twice, and too many breakpoints)

    def breakpoints(self) -> list[tuple[int, PromptCacheBreakpoint]]:
        """Each `prompt_cache_breakpoint`, with the index of the message it ends."""
        return [(index, part.prompt_cache_breakpoint) for index, message in enumerate(self.messages)
                if isinstance(message.content, list) for part in message.content
                if part.prompt_cache_breakpoint is not None]

    def conversation(self) -> tuple[str | None, list[Message], list[Message]]:
        """(system prompt, the history, the turn's new messages: those after the last reply), the way a chatd
        session holds them."""
        messages = [m.message() for m in self.messages]
        system = messages[0].content if messages[0].role == "system" and len(messages) > 1 else None
        rest = messages[1 if system is not None else 0:]
        replies = [index for index, message in enumerate(rest) if message.role == "assistant"]
        new_from = replies[-1] + 1 if replies else len(rest) - 1
        return system, rest[:new_from], rest[new_from:]

    def tool_setup(self, format: ToolFormat) -> ToolSetup:
        """The request's tools and response format, checked; `RequestRefused` naming what is wrong."""
        check_tool_results([m.message() for m in self.messages])
        response_schema = None
        if self.response_format is not None and self.response_format.type == "json_object":
            response_schema = {"type": "object"}
        elif self.response_format is not None and self.response_format.type == "json_schema":
            if self.response_format.json_schema is None:
                raise RequestRefused("response_format.json_schema", "response_format json_schema needs json_schema")
            response_schema = checked_schema(self.response_format.json_schema.schema_,
                                             "response_format.json_schema.schema")
        functions = [Function(t.function.name, t.function.description, t.function.parameters or
                              {"type": "object", "properties": {}}) for t in self.tools or ()]
        choice, allowed = self.tool_choice, None
        if isinstance(choice, NamedToolChoice):
            choice = choice.function.name
        elif isinstance(choice, AllowedToolsChoice):
            choice, allowed = choice.allowed_tools.mode, [tool.function.name for tool in choice.allowed_tools.tools]
        return tool_setup(format, functions, choice, self.parallel_tool_calls, response_schema, allowed=allowed)

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionTokensDetails(BaseModel):
    """`prompt_tokens_details`: the prompt tokens reused from a cache, and those the turn wrote into it."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


class CompletionUsage(BaseModel):
    """A completion's token counts."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: CompletionTokensDetails


class FunctionCallOut(BaseModel):
    """The function and arguments of a call in a reply."""

    name: str
    arguments: str


class ToolCallOut(BaseModel):
    """A call in a reply."""

    id: str
    type: Literal["function"] = "function"
    function: FunctionCallOut


class AssistantMessage(BaseModel):
    """The reply of a non-streamed completion."""

    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None


class Choice(BaseModel):
    """The one choice of a non-streamed completion."""

    index: int = 0
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: None = None


class ChatCompletion(BaseModel):
    """A non-streamed chat completion."""

    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[Choice]
    usage: CompletionUsage


class FunctionCallDelta(BaseModel):
    """A piece of a streamed call: the name in its first chunk, then fragments of the arguments."""

    name: str | None = None
    arguments: str | None = None


class ToolCallDelta(BaseModel):
    """A streamed call's chunk: its index, and its id and type in its first chunk."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: FunctionCallDelta


class ChunkDelta(BaseModel):
    """What one streamed chunk adds: the role first, then text or calls."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChunkChoice(BaseModel):
    """The one choice of a streamed chunk."""

    index: int = 0
    delta: ChunkDelta
    finish_reason: FinishReason | None = None
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
