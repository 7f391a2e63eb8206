"""A conversation's items as the Conversations API lists them (its system prompt, each message's text, a reply's calls,
a tool's result), and the history left when one is deleted. Items are numbered by their message's place, a number
that stays fixed once an item before it is deleted (`Session.numbered_messages`), so ids never move."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from chatd.api.openai.response_turns import function_call
from chatd.api.openai.responses_schema import InputItem, ItemList, ListedFunctionOutput, OutputFunctionCall
from chatd.api.tool_calling import RequestRefused
from sessions import Message, Session

ListedItem = InputItem | OutputFunctionCall | ListedFunctionOutput


@dataclass(frozen=True)
class EditedHistory:
    """A conversation's history with one item left out, as `SessionStore.rewrite` takes it."""

    system: str | None
    messages: list[Message]
    removed_items: int
    dropped_turns: int


def listed_message(item_id: str, message: Message) -> list[ListedItem]:
    """A session's message as a conversation's items: a reply's text and each of its calls, a tool's result."""
    if message.role == "tool":
        return [ListedFunctionOutput(id=f"fco_{item_id}", call_id=message.tool_call_id or "", output=message.content)]
    kind = "output_text" if message.role == "assistant" else "input_text"
    text = [] if message.tool_calls and not message.content else \
        [InputItem(id=f"msg_{item_id}", role=message.role, content=[{"type": kind, "text": message.content}])]
    return text + [function_call(call) for call in message.tool_calls]


def items_of(conversation_id: str, session: Session, start: int | None = None) -> list[ListedItem]:
    """A conversation's items, oldest first: its system prompt, then each message as `listed_message` lists it (with
    `start`, only the messages from that position on)."""
    system = [] if session.system is None or start is not None else \
        listed_message(f"{conversation_id}_0", Message("system", session.system))
    return system + [item for position in range(start or 0, len(session.messages))
                     for item in listed_message(f"{conversation_id}_{session.item_number(position)}",
                                                session.messages[position])]


def item_list(items: list[ListedItem]) -> ItemList:
    """A page of items, with its first and last ids."""
    return ItemList(data=items, first_id=items[0].id if items else None, last_id=items[-1].id if items else None)


def without_item(conversation_id: str, session: Session, item_id: str) -> EditedHistory | None:
    """The conversation's history without the item `item_id` (None: it has none such): the system prompt, a message,
    a tool's result, a reply's text (its calls stay) or one of its calls (refused while the call's result is still
    there: a result answering no call cannot be rendered)."""
    messages = session.numbered_messages()
    if session.system is not None and item_id == f"msg_{conversation_id}_0":
        return EditedHistory(None, messages, session.removed_items + 1, session.dropped_turns)
    for position, message in enumerate(messages):
        key = f"{conversation_id}_{message.item}"
        if item_id == (f"fco_{key}" if message.role == "tool" else f"msg_{key}") and \
                (message.content or not message.tool_calls):
            if message.tool_calls:
                return _replaced(session, messages, position, dataclasses.replace(message, content="",
                                                                                  token_ids=None))
            return _removed(session, messages, position)
        call = next((call for call in message.tool_calls if function_call(call).id == item_id), None)
        if call is not None:
            if any(later.tool_call_id == call.id for later in messages[position + 1:]):
                raise RequestRefused("item_id", f"the output of call {call.id!r} is still in the conversation: "
                                                "delete it first")
            calls = tuple(other for other in message.tool_calls if other is not call)
            if calls or message.content:
                return _replaced(session, messages, position, dataclasses.replace(message, tool_calls=calls,
                                                                                  token_ids=None))
            return _removed(session, messages, position)
    return None


def _replaced(session: Session, messages: list[Message], position: int, message: Message) -> EditedHistory:
    return EditedHistory(session.system, messages[:position] + [message] + messages[position + 1:],
                         session.removed_items, session.dropped_turns)


def _removed(session: Session, messages: list[Message], position: int) -> EditedHistory:
    """`messages` without the one at `position`; a reply among the turns the prompt leaves out is one fewer of them."""
    turn = sum(1 for message in messages[:position] if message.role == "assistant")
    dropped = session.dropped_turns - (messages[position].role == "assistant" and turn < session.dropped_turns)
    return EditedHistory(session.system, messages[:position] + messages[position + 1:], session.removed_items + 1,
                         dropped)
