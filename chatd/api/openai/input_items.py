"""The input items of a Responses request, as clients send them: messages (text, and media parts read so that they are
refused by name), function calls and their outputs, references to earlier output items, reasoning items."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from chatd.api.constants import FUNCTION_NAME
from chatd.api.openai.prompt_cache import PromptCacheBreakpoint
from sessions import Message


class InputText(BaseModel):
    """A text part of an input message (`input_text`; `output_text` for an assistant's earlier reply)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_text", "output_text", "text"]
    text: str
    prompt_cache_breakpoint: PromptCacheBreakpoint | None = None


class MediaPart(BaseModel):
    """An image, file or audio part: read so that it is refused by name (the served model reads text only)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["input_image", "input_file", "input_audio"]


class InputMessage(BaseModel):
    """One message item of `input` (or of a conversation's `items`)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[Annotated[InputText | MediaPart, Field(discriminator="type")]]

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else \
            "".join(part.text for part in self.content if isinstance(part, InputText))

    def message(self) -> Message:
        return Message("system" if self.role == "developer" else self.role, self.text())

    def breakpoints(self) -> list[PromptCacheBreakpoint]:
        return [part.prompt_cache_breakpoint for part in self.content if isinstance(part, InputText) and
                part.prompt_cache_breakpoint is not None] if isinstance(self.content, list) else []


class FunctionCallItem(BaseModel):
    """A call an earlier reply made, as the client sends it back (and as a response's output lists it)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(pattern=FUNCTION_NAME)
    arguments: str = Field(max_length=256 * 1024)
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(BaseModel):
    """A function's result, answering the call `call_id`."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: str | list[InputText]
    id: str | None = None

    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(part.text for part in self.output)


class ItemReference(BaseModel):
    """An earlier output item named by its id (`msg_…`, `fc_…`), as clients with `store` on send their history (the
    AI SDK): replaced by the item itself before anything else reads the input."""

    type: Literal["item_reference"]
    id: str = Field(min_length=1, max_length=128)


class CompactionItem(BaseModel):
    """A compaction item `POST /v1/responses/compact` returned: the compacted window, whose session a response that
    sends it continues (the items before it are the window's own, and are not read again)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["compaction"]
    encrypted_content: str = Field(min_length=1, max_length=256)
    id: str | None = None

    PREFIX: ClassVar[str] = "chatd.window:"

    @classmethod
    def content_for(cls, session_id: str, version: int, messages: int) -> str:
        """The item's content: the window's session and its point (the version and messages it had when made)."""
        return f"{cls.PREFIX}{session_id}:{version}:{messages}"

    def point(self) -> tuple[str, int, int] | None:
        """(session id, version, messages) of the window (None: not a compaction chatd made)."""
        parts = self.encrypted_content.removeprefix(self.PREFIX).rsplit(":", 2)
        if not self.encrypted_content.startswith(self.PREFIX) or len(parts) != 3 or \
                not (parts[1].isdigit() and parts[2].isdigit()):
            return None
        return parts[0], int(parts[1]), int(parts[2])


class ReasoningItem(BaseModel):
    """A reasoning item a client carries over from another model: passed over (the served model does not reason)."""

    model_config = ConfigDict(extra="ignore")

    type: Literal["reasoning"]


InputItemIn = Annotated[InputMessage | FunctionCallItem | FunctionCallOutputItem | ItemReference | ReasoningItem |
                        CompactionItem, Field(union_mode="left_to_right")]
SentItem = InputMessage | FunctionCallItem | FunctionCallOutputItem | ItemReference | ReasoningItem | CompactionItem
