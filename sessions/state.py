"""The state of one conversation, independent of where it is stored or how it is served."""

from __future__ import annotations

import dataclasses
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant", "tool"]


@dataclass(frozen=True)
class ToolCall:
    """A function call in a reply: its id, the function's name and its arguments as JSON text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class Message:
    """One message of a conversation: a reply may carry function calls, a tool message answers one."""

    role: Role
    content: str
    # For a reply: the ids the model generated (its text and any calls in the model's own format). A prompt
    # splices them in rather than re-rendering the reply (which may tokenize differently and miss the cache).
    token_ids: tuple[int, ...] | None = field(default=None, compare=False)
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None  # a tool message: the call it answers
    # Its number among the conversation's items, fixed once an item before it was deleted (None: its position)
    item: int | None = field(default=None, compare=False)


def as_inputs(new: str | Sequence[Message]) -> list[Message]:
    """A turn's new messages: a user message's text, or the messages themselves (tool results, say)."""
    return [Message("user", new)] if isinstance(new, str) else list(new)


@dataclass
class Session:
    """A conversation: its system prompt, the messages of its completed turns, the token ids the
    conversation has reached, and a version that counts completed turns (for writers to agree on)."""

    session_id: str
    system: str | None = None
    messages: list[Message] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    version: int = 0
    owner: str | None = None  # who may use it: the id of the API key that created it
    dropped_turns: int = 0  # oldest turns left out of the prompt, to fit the model's context
    # What every turn is asked with unless its request says otherwise (tools, tool choice, reply format): JSON
    # the store keeps as given, since it shapes the prompt and so the cache.
    tool_options: dict | None = None
    removed_items: int = 0  # messages deleted from it (a conversation's item numbers count on past them)
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "assistant")

    def messages_with_system(self) -> list[Message]:
        head = [Message("system", self.system)] if self.system else []
        return head + self.messages

    def prompt_messages(self, new: str | Sequence[Message]) -> list[Message]:
        """The messages a new turn renders: system prompt, history, then the new message(s)."""
        return self.messages_with_system() + as_inputs(new)

    def numbered_messages(self) -> list[Message]:
        """Its messages, each with the number a conversation lists it by made fixed, so that deleting one leaves the
        others' ids as they were: the system prompt is item 0 when there is one, then each message by its position,
        counted on past the messages deleted before."""
        return [dataclasses.replace(message, item=self.item_number(position))
                for position, message in enumerate(self.messages)]

    def item_number(self, position: int) -> int:
        """The number the conversation lists its message at `position` by (`numbered_messages`)."""
        message = self.messages[position]
        return message.item if message.item is not None else \
            (0 if self.system is None else 1) + position + self.removed_items

    def rewrite(self, system: str | None, messages: Sequence[Message], removed_items: int, dropped_turns: int) -> None:
        """Take an edited history (an item deleted): a new version, whose reached token ids are not known until its
        next turn."""
        self.system, self.messages, self.removed_items = system, list(messages), removed_items
        self.dropped_turns, self.token_ids = dropped_turns, []
        self.version += 1
        self.updated_at = time.time()

    def record_turn(self, new: str | Sequence[Message], reply: str | None, token_ids: list[int] | None = None,
                    dropped_turns: int | None = None, reply_ids: Sequence[int] | None = None,
                    tool_calls: Sequence[ToolCall] = ()) -> None:
        """Add a completed turn: its new message(s) and the reply (with its calls); `token_ids` are the ids the
        conversation has reached with it, and `reply_ids` the reply's own (when it is exactly what they say).
        A warm-up (`reply` None) adds its messages alone."""
        self.messages += turn_messages(new, reply, reply_ids, tool_calls)
        if token_ids is not None:
            self.token_ids = list(token_ids)
        if dropped_turns is not None:
            self.dropped_turns = dropped_turns
        self.version += 1
        self.updated_at = time.time()


def turn_messages(new: str | Sequence[Message], reply: str | None, reply_ids: Sequence[int] | None = None,
                  tool_calls: Sequence[ToolCall] = ()) -> list[Message]:
    """What a completed turn adds to its session: its new messages, then its reply unless it had none (a
    warm-up)."""
    inputs = as_inputs(new)
    if reply is None:
        return inputs
    return inputs + [Message("assistant", reply, tuple(reply_ids) if reply_ids is not None else None,
                             tuple(tool_calls))]


def new_session_id() -> str:
    """128 random bits, URL-safe."""
    return secrets.token_urlsafe(16)
