"""The state of one conversation, independent of where it is stored or how it is served."""

from __future__ import annotations

import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["system", "user", "assistant"]


@dataclass(frozen=True)
class Message:
    """One message of a conversation."""

    role: Role
    content: str
    # For a reply: the ids the model generated, which `content` decodes to. A prompt splices them in
    # rather than re-tokenizing the text (which may tokenize differently and miss the cache).
    token_ids: tuple[int, ...] | None = field(default=None, compare=False)


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
    created_at: float = field(default_factory=time.time)
    updated_at: float = field(default_factory=time.time)

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m.role == "assistant")

    def messages_with_system(self) -> list[Message]:
        head = [Message("system", self.system)] if self.system else []
        return head + self.messages

    def prompt_messages(self, user_content: str) -> list[Message]:
        """The messages a new turn renders: system prompt, history, then the new user message."""
        return self.messages_with_system() + [Message("user", user_content)]

    def record_turn(self, user_content: str, reply: str, token_ids: list[int] | None = None,
                    dropped_turns: int | None = None, reply_ids: Sequence[int] | None = None) -> None:
        """Add a completed turn; `token_ids` are the ids the conversation has reached with it, and
        `reply_ids` the reply's own (when its text decodes from exactly them)."""
        self.messages += [Message("user", user_content),
                          Message("assistant", reply, tuple(reply_ids) if reply_ids is not None else None)]
        if token_ids is not None:
            self.token_ids = list(token_ids)
        if dropped_turns is not None:
            self.dropped_turns = dropped_turns
        self.version += 1
        self.updated_at = time.time()


def new_session_id() -> str:
    """128 random bits, URL-safe."""
    return secrets.token_urlsafe(16)
