"""The bodies of OpenAI's Responses API (`/v1/responses`) and Conversations API (`/v1/conversations`) as
chatd serves them: messages, function calls and their outputs in, text and calls out, state kept as chatd
sessions. See docs/protocol.md for what is accepted and refused."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from chatd.api.constants import FUNCTION_NAME
from chatd.api.openai.input_items import (
    FunctionCallItem,
    FunctionCallOutputItem,
    InputItemIn,
    InputMessage,
    MediaPart,
    ReasoningItem,
    SentItem,
)
from chatd.api.openai.prompt_cache import PromptCacheBreakpoint, PromptCacheControls
from chatd.api.openai.request_body import RequestBody
from chatd.api.tool_calling import Function, RequestRefused, ToolFormat, ToolSetup, checked_schema, tool_setup
from sessions import Message, ToolCall


class FunctionTool(BaseModel):
    """A function tool of a response request (the Responses API's flat shape)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function"]
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = Field(None, max_length=16 * 1024)
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseRequest(RequestBody, PromptCacheControls):
    """Unknown fields are ignored; fields that would change the meaning of the reply are refused by
    `refuse_unsupported`, naming the parameter."""

    model: str
    input: str | list[InputItemIn] = Field(default_factory=list)
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
    cache_salt: str | None = Field(None, max_length=256)  # vLLM's field: caches shared only among the same salt
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)  # function tools; any other kind is refused
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    # False: a warm-up, its prompt prefilled into the session's cache and nothing generated (WebSocket mode's
    # field; `prompt_cache_options.prewarm` says the same).
    generate: bool = True
    prompt_cache_key: str | None = Field(None, max_length=128)
    safety_identifier: str | None = Field(None, max_length=256)
    # OpenAI's default: a conversation over the context is refused (`auto`: its oldest turns are dropped).
    truncation: Literal["auto", "disabled"] = "disabled"
    # Accepted only where they change nothing.
    reasoning: Any = None
    background: bool | None = None
    include: list[str] | None = None

    def refuse_unsupported(self) -> None:
        """Raise `RequestRefused` for a parameter whose meaning chatd does not implement."""
        if self.reasoning is not None:
            raise RequestRefused("reasoning", "reasoning is not supported: the served model does not reason")
        if self.background:
            raise RequestRefused("background", "background responses are not supported")
        if self.cache_salt is not None and self.conversation_id():
            raise RequestRefused("cache_salt", "cache_salt scopes stateless requests and previous_response_id "
                                               "chains; a conversation is one session already")
        for item in self.include or []:
            raise RequestRefused("include", f"include {item!r} is not supported")
        if self.previous_response_id and self.conversation:
            raise RequestRefused("conversation", "give previous_response_id or conversation, not both")
        self.keep_for_s()  # (refuses a ttl given twice, and too many breakpoints)
        for index, item in enumerate(self.items()):
            for part_index, part in enumerate(item.content if isinstance(item, InputMessage) and
                                              isinstance(item.content, list) else ()):
                if isinstance(part, MediaPart):
                    raise RequestRefused(f"input[{index}].content[{part_index}]", f"{part.type} parts are not "
                                         "supported: the served model reads text only")
        items = [item for item in self.items() if not isinstance(item, ReasoningItem)]
        if self.warm_up:
            if not items and not self.instructions and not self.tools and not self.previous_response_id:
                raise RequestRefused("input", "a warm-up (generate: false) prefills instructions, tools, the response "
                                              "it continues or input: it names none")
            return
        if not items or isinstance(items[-1], FunctionCallItem) or \
                (isinstance(items[-1], InputMessage) and items[-1].role != "user"):
            raise RequestRefused("input", "the last input item must be the user's message or a function call's "
                                          "output: chatd answers it")

    @property
    def warm_up(self) -> bool:
        """Whether this only prefills its prompt (`generate: false`, or `prompt_cache_options.prewarm`)."""
        return not self.generate or (self.prompt_cache_options is not None and self.prompt_cache_options.prewarm)

    def items(self) -> list[SentItem]:
        """`input` as items, as the client sent them (after its item references are resolved: `with_items`)."""
        return [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else list(self.input)

    def messages(self) -> list[Message]:
        """`input` as a session's messages: a reply's text and the calls after it are one assistant message,
        a call's output a tool message."""
        return self._messages_and_breakpoints()[0]

    def breakpoints(self) -> list[tuple[int, PromptCacheBreakpoint]]:
        """Each `prompt_cache_breakpoint`, with the index in `messages()` of the message it ends."""
        return self._messages_and_breakpoints()[1]

    def _messages_and_breakpoints(self) -> tuple[list[Message], list[tuple[int, PromptCacheBreakpoint]]]:
        messages: list[Message] = []
        marks: list[tuple[int, PromptCacheBreakpoint]] = []
        for item in self.items():  # (reasoning items are passed over)
            if isinstance(item, FunctionCallItem):
                call = ToolCall(item.call_id, item.name, item.arguments)
                if messages and messages[-1].role == "assistant":
                    last = messages.pop()
                    messages.append(Message("assistant", last.content, tool_calls=last.tool_calls + (call,)))
                else:
                    messages.append(Message("assistant", "", tool_calls=(call,)))
            elif isinstance(item, FunctionCallOutputItem):
                messages.append(Message("tool", item.text(), tool_call_id=item.call_id))
            elif isinstance(item, InputMessage):
                messages.append(item.message())
                marks += [(len(messages) - 1, mark) for mark in item.breakpoints()]
        return messages, marks

    def split(self) -> tuple[list[Message], list[Message]]:
        """(what `input` adds before the turn, the turn's new messages: those after its last reply)."""
        messages = self.messages()
        replies = [index for index, message in enumerate(messages) if message.role == "assistant"]
        if replies:
            new_from = replies[-1] + 1
        elif self.warm_up:  # (all of a warm-up's input is its turn's, but a leading system message)
            new_from = 1 if messages and messages[0].role == "system" else 0
        else:
            new_from = len(messages) - 1
        return messages[:new_from], messages[new_from:]

    def check_outputs(self, earlier_calls: Iterable[str] = ()) -> None:
        """Every function_call_output answers a call of the history (`earlier_calls`) or of `input`."""
        calls = set(earlier_calls)
        for index, item in enumerate(self.items()):
            if isinstance(item, FunctionCallItem):
                calls.add(item.call_id)
            elif isinstance(item, FunctionCallOutputItem) and item.call_id not in calls:
                raise RequestRefused(f"input[{index}].call_id", f"the function_call_output input[{index}] "
                                     f"answers {item.call_id!r}, which no earlier function_call made")

    def tool_setup(self, format: ToolFormat) -> ToolSetup:
        """The request's tools, `tool_choice` and `text.format`, checked; `RequestRefused` naming what is wrong."""
        functions = []
        for index, tool in enumerate(self.tools or ()):
            if tool.get("type") != "function":
                raise RequestRefused(f"tools[{index}].type", f"only function tools are supported, not "
                                                             f"{tool.get('type')!r}")
            try:
                function = FunctionTool.model_validate(tool)
            except ValidationError as error:
                first = error.errors()[0]
                where = ".".join(str(part) for part in first["loc"])
                raise RequestRefused(f"tools[{index}].{where}", f"tools[{index}].{where}: {first['msg']}") from None
            functions.append(Function(function.name, function.description,
                                      function.parameters or {"type": "object", "properties": {}}))
        choice, allowed = self.tool_choice, None
        if isinstance(choice, dict) and choice.get("type") == "allowed_tools":
            tools = choice.get("tools")
            if choice.get("mode") not in ("auto", "required") or not isinstance(tools, list) or \
                    not all(isinstance(tool, dict) and isinstance(tool.get("name"), str) for tool in tools):
                raise RequestRefused("tool_choice", "allowed_tools takes mode auto or required and tools: "
                                                    "[{\"type\": \"function\", \"name\": …}]")
            choice, allowed = choice["mode"], [tool["name"] for tool in tools]
        elif isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise RequestRefused("tool_choice", "tool_choice must be none, auto, required, "
                                                    "{\"type\": \"function\", \"name\": …} or allowed_tools")
            choice = choice["name"]
        return tool_setup(format, functions, choice, self.parallel_tool_calls is not False, self.response_schema(),
                          allowed=allowed)

    def response_schema(self) -> dict | None:
        """The JSON Schema `text.format` holds the reply to, if any."""
        text_format = (self.text or {}).get("format") or {"type": "text"}
        kind = text_format.get("type")
        if kind == "text":
            return None
        if kind == "json_object":
            return {"type": "object"}
        if kind == "json_schema":
            return checked_schema(text_format.get("schema"), "text.format.schema")
        raise RequestRefused("text.format.type", f"text.format type {kind!r} is not supported: text, json_object "
                                                 "or json_schema")

    def input_record(self) -> list[dict]:
        """The input items as stored with the response and listed by its input_items."""
        return [json.loads(item.model_dump_json(exclude_none=True)) for item in self.items()
                if not isinstance(item, ReasoningItem)]

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


class OutputFunctionCall(BaseModel):
    """A call the reply makes, as an output item (and as a conversation lists it)."""

    id: str
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str
    status: Literal["in_progress", "completed", "incomplete"] = "completed"


class ListedFunctionOutput(BaseModel):
    """A function's result, as a response's input items and a conversation list it."""

    id: str
    type: Literal["function_call_output"] = "function_call_output"
    call_id: str
    output: str
    status: Literal["completed"] = "completed"


class InputTokensDetails(BaseModel):
    """The input tokens a cache covered, and those the turn prefilled and wrote into its session's cache (read from
    it by the conversation's next turn)."""

    cached_tokens: int = 0
    cache_write_tokens: int = 0


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
    """Why a response is incomplete: its reply reached max_output_tokens, (`grammar_error`) the model could not go
    on within its tools' or format's grammar, or (`steered`) it stopped for the client's new input."""

    reason: Literal["max_output_tokens", "grammar_error", "steered"] = "max_output_tokens"


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
    output: list[OutputMessage | OutputFunctionCall] = Field(default_factory=list)
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
    tools: list[dict[str, Any]] = Field(default_factory=list)
    tool_choice: str | dict[str, Any] = "auto"
    parallel_tool_calls: bool = True
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    # The rest of what OpenAI's spec requires of a response (typed clients validate it), with chatd's values.
    completed_at: int | None = None
    truncation: Literal["auto", "disabled"] = "disabled"
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    top_logprobs: int = 0
    reasoning: dict[str, Any] | None = None  # (the served models do not reason apart)
    max_tool_calls: int | None = None
    background: bool = False
    service_tier: str = "default"
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_diagnostics: dict[str, Any] | None = None


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
    data: list[InputItem | OutputFunctionCall | ListedFunctionOutput]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class ConversationCreate(BaseModel):
    """The body of POST /v1/conversations."""

    model_config = ConfigDict(extra="ignore")

    items: list[InputMessage] | None = Field(None, max_length=1000)
    metadata: dict[str, str] | None = Field(None, max_length=16)


class ConversationItemsAdd(BaseModel):
    """The body of POST /v1/conversations/{id}/items: input items appended to the conversation (at most 20, as
    OpenAI's)."""

    model_config = ConfigDict(extra="ignore")

    items: list[InputItemIn] = Field(min_length=1, max_length=20)


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
