"""The websocket protocol's tools, tool choice and reply format as the `ToolSetup` a turn runs with (the
session's, each field a `chat.request` gives replacing it), and a request's tool results as the messages they
add to the session: the same formats, grammars and parsers the OpenAI surfaces use."""

from __future__ import annotations

from collections.abc import Sequence

from chatd.api.tool_calling import Function, RequestRefused, ToolFormat, ToolSetup, checked_schema, tool_setup
from chatd.api.websocket.protocol import NamedTool, ToolFields, ToolResult
from sessions import Message


def setup_for(format: ToolFormat, session_options: dict | None, request: ToolFields | None = None) -> ToolSetup:
    """What a turn runs with: the session's options, with each field the request gives in their place;
    `RequestRefused` naming a field that is wrong (an invalid schema, a tool_choice naming no listed tool)."""
    given = {**(session_options or {}), **(request.tool_options() if request is not None else {})}
    fields = ToolFields.model_validate(given)
    functions = [Function(tool.name, tool.description, tool.parameters or {"type": "object", "properties": {}})
                 for tool in fields.tools or ()]
    choice = fields.tool_choice.name if isinstance(fields.tool_choice, NamedTool) else fields.tool_choice
    reply_format, schema = fields.response_format, None
    if reply_format is not None and reply_format.type == "json_object":
        schema = {"type": "object"}
    elif reply_format is not None and reply_format.type == "json_schema":
        schema = checked_schema(reply_format.schema_, "response_format.schema")
    return tool_setup(format, functions, choice, fields.parallel_tool_calls is not False, schema)


def result_messages(history: Sequence[Message], results: Sequence[ToolResult]) -> list[Message]:
    """The tool messages a request's results add; `RequestRefused` for a result that answers no call of the
    session."""
    calls = {call.id for message in history for call in message.tool_calls}
    for index, result in enumerate(results):
        if result.call_id not in calls:
            raise RequestRefused(f"tool_results[{index}].call_id", f"tool_results[{index}] answers "
                                 f"{result.call_id!r}, which no reply of this session called")
    return [Message("tool", result.content, tool_call_id=result.call_id) for result in results]
