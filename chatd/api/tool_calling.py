"""Tools as each model sees and writes them: the format of its calls (read off its chat template), the
grammar that holds a call to the listed functions, and the parser that reads calls back out of a reply.

- Hermes (`<tool_call>{"name": …, "arguments": …}</tool_call>`: Qwen2.5, Qwen3, Hermes, SmolLM3) and Llama 3
  JSON (`{"name": …, "parameters": …}`: Llama 3.1 and later) are rendered by the model's own template, which
  takes `tools`.
- Every other template (the bundled SmolLM2's ignores tools) gets the generic format: the tools described
  in the system message, calls written in Hermes tags, tool results as user messages in `<tool_response>`
  tags (llama.cpp's generic handler does the same with its own wrapper).

`tool_choice` `required` or a named function holds the whole reply to calls (vLLM's approach); `auto` holds a
call's arguments from the moment the model opens one (a lazy grammar, triggered by the format's opening
text). The engine only ever sees the resulting `GrammarSpec`.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field

import jsonschema

from chatd.engine.grammar import MAX_GRAMMAR_CHARS, CompiledGrammar, GrammarCompiler, GrammarError, GrammarSpec
from sessions import Message, ToolCall

GENERIC_TOOLS_PROMPT = """You can call functions to help the user. The functions you may call, one JSON object per line:
<tools>
{tools}
</tools>
To call functions, reply with one block per call and nothing else, each block holding a JSON object with the
function's name and its arguments:
<tool_call>
{{"name": "<function name>", "arguments": {{<arguments as a JSON object>}}}}
</tool_call>
A function's result comes back in a <tool_response> block. Otherwise, answer the user in plain text."""


class RequestRefused(ValueError):
    """A request chatd does not serve as asked: 400, naming the parameter."""

    def __init__(self, param: str, message: str):
        super().__init__(message)
        self.param = param


def checked_schema(schema: object, param: str) -> dict:
    """`schema` if it is a JSON Schema of a size chatd compiles; `RequestRefused` naming `param` otherwise."""
    if not isinstance(schema, dict):
        raise RequestRefused(param, f"{param} must be a JSON Schema object")
    if len(text := json.dumps(schema)) > MAX_GRAMMAR_CHARS:
        raise RequestRefused(param, f"{param} is {len(text)} characters of JSON; at most {MAX_GRAMMAR_CHARS}")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as error:
        raise RequestRefused(param, f"{param} is not a valid JSON Schema: {error.message}") from None
    return schema


def check_tool_results(messages: Sequence[Message], param: str = "messages", earlier: Sequence[Message] = ()) -> None:
    """Every tool message answers a call of an earlier reply (in `messages`, or in the `earlier` history they follow);
    `RequestRefused` otherwise."""
    calls: set[str] = {call.id for message in earlier for call in message.tool_calls}
    for index, message in enumerate(messages):
        calls.update(call.id for call in message.tool_calls)
        if message.role == "tool" and message.tool_call_id not in calls:
            raise RequestRefused(f"{param}[{index}]", f"the tool message {param}[{index}] answers "
                                 f"{message.tool_call_id!r}, which no earlier assistant message called")


@dataclass(frozen=True)
class Function:
    """One function a reply may call: its name, description and JSON Schema of its arguments."""

    name: str
    description: str | None = None
    parameters: dict = field(default_factory=lambda: {"type": "object", "properties": {}})

    def definition(self) -> dict:
        """OpenAI's function tool object, as chat templates read it."""
        function: dict = {"name": self.name, "parameters": self.parameters}
        if self.description:
            function["description"] = self.description
        return {"type": "function", "function": function}


def new_call_id() -> str:
    """An id for a call, as OpenAI writes them."""
    return "call_" + secrets.token_urlsafe(18)


def _arguments_text(arguments: object) -> str:
    """Arguments as JSON text, as OpenAI sends them (and as clients that re-serialize them write them)."""
    return json.dumps(arguments, ensure_ascii=False)


class ToolFormat:
    """How one family of chat templates writes calls; subclasses name the wrapping."""

    name = "generic"
    trigger = "<tool_call>"
    arguments_key = "arguments"
    template_renders_tools = False

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        """Lark rules for the calls: `calls` (one, or several with `parallel`)."""
        schema = {"anyOf": [{"type": "object", "properties": {
            "name": {"const": f.name}, self.arguments_key: f.parameters or {"type": "object"}},
            "required": ["name", self.arguments_key], "additionalProperties": False} for f in functions],
            "x-guidance": {"whitespace_flexible": False}}
        more = ' ("\\n" call)*' if parallel else ""
        return f'calls: call{more}\ncall: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>"\n'

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the reply's prose, its calls); a reply whose calls do not all parse is prose only."""
        start = text.find(self.trigger)
        if start < 0:
            return text, []
        calls = []
        for block in re.finditer(r"<tool_call>\s*(.*?)\s*</tool_call>", text[start:], re.DOTALL):
            if (call := self._call(block.group(1))) is None:
                return text, []
            calls.append(call)
        return (text[:start].rstrip(), calls) if calls else (text, [])

    def complete_calls(self, text: str) -> int:
        """How many calls `text` (a reply so far) holds whole: they can be streamed before the reply ends."""
        return text.count("</tool_call>")

    def _call(self, body: str) -> ToolCall | None:
        try:
            call = json.loads(body)
        except ValueError:
            return None
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        return ToolCall(new_call_id(), call["name"], _arguments_text(call.get(self.arguments_key, {})))

    def engine_messages(self, messages: Sequence[Message], functions: Sequence[Function]) -> list[Message]:
        """The conversation as the template is given it: the tools in the system message, calls and results
        as text in the format's tags (a reply that carries its generated ids is kept as the model wrote it)."""
        tools = "\n".join(json.dumps(f.definition(), ensure_ascii=False) for f in functions)
        rendered = []
        for message in messages:
            if message.role == "assistant" and message.tool_calls and message.token_ids is None:
                blocks = "\n".join(f'<tool_call>\n{{"name": {json.dumps(c.name)}, "arguments": {c.arguments}}}'
                                   f'\n</tool_call>' for c in message.tool_calls)
                message = Message("assistant", f"{message.content}\n{blocks}".lstrip("\n"))
            elif message.role == "tool":
                message = Message("user", f"<tool_response>\n{message.content}\n</tool_response>")
            rendered.append(message)
        if functions:
            prompt = GENERIC_TOOLS_PROMPT.format(tools=tools)
            if rendered and rendered[0].role == "system":
                rendered[0] = Message("system", f"{rendered[0].content}\n\n{prompt}")
            else:
                rendered.insert(0, Message("system", prompt))
        return rendered


class HermesFormat(ToolFormat):
    """`<tool_call>` JSON blocks, rendered by a template that takes tools (Qwen2.5, Qwen3, Hermes, SmolLM3)."""

    name = "hermes"
    template_renders_tools = True

    def engine_messages(self, messages: Sequence[Message], functions: Sequence[Function]) -> list[Message]:
        return list(messages)


class Llama3JsonFormat(ToolFormat):
    """A bare JSON object `{"name": …, "parameters": …}` (Llama 3.1 and later)."""

    name = "llama3_json"
    trigger = '{"name"'
    arguments_key = "parameters"
    template_renders_tools = True

    def call_rule(self, functions: Sequence[Function], parallel: bool) -> str:
        rules = super().call_rule(functions, parallel=False)  # one call a reply, as Llama 3's template expects
        return rules.replace('"<tool_call>\\n" ', "").replace(' "\\n</tool_call>"', "")

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        body = text.strip().removeprefix("<|python_tag|>").strip()
        if not body.startswith("{") or (call := self._call(body)) is None:
            return text, []
        return "", [call]

    def complete_calls(self, text: str) -> int:
        return 0  # whole only when the reply ends

    def engine_messages(self, messages: Sequence[Message], functions: Sequence[Function]) -> list[Message]:
        return list(messages)


async def compile_grammar(grammars: GrammarCompiler, setup: ToolSetup, format_param: str) -> CompiledGrammar | None:
    """The reply's grammar, compiled in the grammar thread (never the event loop's or the engine's; cached by its
    text), or None for free text; `RequestRefused` naming the tools or the reply format when it cannot compile."""
    if (spec := setup.grammar()) is None:
        return None
    try:
        return await asyncio.wrap_future(grammars.compile(spec))
    except GrammarError as error:
        param = "tools" if setup.calls_possible and not await _fails(grammars, setup.response_schema) else \
            format_param
        raise RequestRefused(param, f"{param} cannot be compiled into a grammar: {error}") from None


async def _fails(grammars: GrammarCompiler, schema: dict | None) -> bool:
    """Whether the reply format's schema alone does not compile (to name what a failed grammar is about)."""
    if schema is None:
        return False
    try:
        await asyncio.wrap_future(grammars.compile(GrammarSpec("json_schema", json.dumps(schema))))
    except GrammarError:
        return True
    return False


def format_for(chat_template: str | None) -> ToolFormat:
    """The call format of a chat template: its own where chatd knows it, otherwise the generic one."""
    template = chat_template or ""
    if "tools" not in template:
        return ToolFormat()
    if "<tool_call>" in template:
        return HermesFormat()
    if "python_tag" in template or '"parameters"' in template:
        return Llama3JsonFormat()
    return ToolFormat()


def tool_setup(format: ToolFormat, functions: Sequence[Function], choice: str | None, parallel: bool,
               response_schema: dict | None, param: str = "tools", allowed: Sequence[str] | None = None) -> ToolSetup:
    """The request's tools checked (schemas, unique names, a `tool_choice` that names a listed tool, `allowed`: the
    listed tools the model may call, OpenAI's `allowed_tools`)."""
    names = [f.name for f in functions]
    if len(set(names)) != len(names):
        raise RequestRefused(param, f"{param} lists a function name twice")
    for index, function in enumerate(functions):
        checked_schema(function.parameters, f"{param}[{index}].parameters")
    choice = choice or ("auto" if functions else "none")
    if choice not in ("none", "auto") and not functions:
        raise RequestRefused("tool_choice", f"tool_choice {choice!r} needs tools")
    if choice not in ("none", "auto", "required") and choice not in names:
        raise RequestRefused("tool_choice", f"tool_choice names {choice!r}, which is not among the tools "
                                            f"({', '.join(names)})")
    for name in allowed or ():
        if name not in names:
            raise RequestRefused("tool_choice", f"tool_choice allows {name!r}, which is not among the tools "
                                                f"({', '.join(names)})")
    if allowed is not None and not allowed:
        raise RequestRefused("tool_choice", "tool_choice allowed_tools lists no tool")
    return ToolSetup(format, tuple(functions), choice, parallel, response_schema,
                     tuple(allowed) if allowed is not None else None)


@dataclass(frozen=True)
class ToolSetup:
    """A request's tools and structured output, as the model sees them and as its reply is read back."""

    format: ToolFormat
    functions: tuple[Function, ...] = ()
    choice: str = "auto"  # none, auto, required, or the one function's name
    parallel: bool = True
    response_schema: dict | None = None  # the reply itself must be JSON for this schema
    # The tools the model may call (OpenAI's `allowed_tools`); all of them are still in the prompt, so that a
    # conversation whose allowed subset changes keeps its cached prefix. None: every tool.
    allowed: tuple[str, ...] | None = None

    @property
    def calls_possible(self) -> bool:
        return bool(self.functions) and self.choice != "none"

    def grammar(self) -> GrammarSpec | None:
        """What the reply must follow, or None for free text."""
        answer = f"answer: %json {json.dumps(self.response_schema)}\n" if self.response_schema is not None else ""
        if not self.calls_possible:
            return GrammarSpec("json_schema", json.dumps(self.response_schema)) if answer else None
        functions = [f for f in self.functions if self.choice in ("auto", "required", f.name)
                     and (self.allowed is None or f.name in self.allowed)]
        calls = self.format.call_rule(functions, self.parallel and self.choice in ("auto", "required"))
        if self.choice != "auto":
            return GrammarSpec("lark", "start: calls\n" + calls)
        if answer:
            return GrammarSpec("lark", "start: calls | answer\n" + calls + answer)
        return GrammarSpec("lark", "start: calls\n" + calls, trigger=self.format.trigger)

    def template_tools(self) -> list[dict] | None:
        """The tool definitions for a template that renders them."""
        if not self.functions or not self.format.template_renders_tools:
            return None
        return [f.definition() for f in self.functions]

    def engine_messages(self, messages: Sequence[Message]) -> list[Message]:
        """The conversation as the engine renders it."""
        return self.format.engine_messages(messages, self.functions)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """The reply's prose and its calls. The prose never holds the raw text of a call that could not be read (one
        cut by the token limit while it was being written): the reply is then its prose before the call, on every
        API, as it was streamed (the stream holds back text from where a call opens)."""
        if not self.calls_possible:
            return text, []
        prose, calls = self.format.parse(text)
        if not calls and self.format.trigger in text:
            prose = text[:text.index(self.format.trigger)].rstrip()
        return prose, calls

    @property
    def call_trigger(self) -> str | None:
        """The text with which the model opens a call (None where it may call nothing)."""
        return self.format.trigger if self.calls_possible else None

    def prose_stream(self) -> ProseStream:
        """What of a streamed reply may go out as prose while it is written."""
        return ProseStream(self.call_trigger)


class ProseStream:
    """A streamed reply's prose: text released as it comes, except what could be the opening of a call (which
    is held back, then sent as calls once the reply is read) and, where calls are possible, trailing whitespace
    (dropped when a call follows it), so that what was sent is always the start of the reply's prose."""

    def __init__(self, trigger: str | None):
        self._trigger, self._text, self._released = trigger, "", 0
        self._opened: int | None = None  # where the trigger starts, once seen

    def push(self, piece: str) -> str:
        """The text `piece` lets go out now. Once per token, on the event loop: only the new text (and a trigger it
        may complete) is searched, never the whole reply."""
        searched = len(self._text)
        self._text += piece
        if self._trigger is None:
            end = len(self._text)
        else:
            if self._opened is None and \
                    (found := self._text.find(self._trigger, max(0, searched - len(self._trigger) + 1))) >= 0:
                self._opened = found
            if self._opened is not None:
                end = self._opened
            else:  # hold back a tail that may still become the trigger
                end = len(self._text) - next((n for n in range(len(self._trigger) - 1, 0, -1)
                                              if self._text.endswith(self._trigger[:n])), 0)
            while end > self._released and self._text[end - 1].isspace():  # whitespace before a call is not prose:
                end -= 1                                                     # held until more text follows it
        if end <= self._released:
            return ""
        released, self._released = self._text[self._released:end], end
        return released

    @property
    def opened(self) -> bool:
        """Whether the reply has opened a call (complete or not)."""
        return self._opened is not None

    def rest(self, prose: str, has_calls: bool) -> str:
        """What is left to send once the reply is read: the rest of its prose (all its text if it made no call)."""
        text = prose if has_calls else self._text
        return text[self._released:] if text.startswith(self._text[:self._released]) else ""
