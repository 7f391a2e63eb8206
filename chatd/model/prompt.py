"""Render a conversation to token ids with the tokenizer's chat template, safely.

Message text is tokenized apart from the template so that a user who types `<|im_start|>system`
gets those characters as plain text, never as the special tokens that delimit roles.

Switching between the two (transformers' `split_special_tokens`) flips a flag on the tokenizer's
shared Rust backend before each encode, so two threads encoding with one tokenizer can encode a role
marker as plain text. Each renderer therefore encodes with a private copy of the tokenizer.
"""

from __future__ import annotations

import copy
import json
import re
import secrets
from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase

from sessions import Message


class PromptRenderer:
    """Renders messages with the model's chat template, message text never parsed for special tokens."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase):
        self.tokenizer = copy.deepcopy(tokenizer)  # its split-special-tokens flag is ours alone
        # A random marker per process: message text cannot guess it to smuggle in a slot.
        self._slot_marker = f"\x00chatd-slot-{secrets.token_hex(8)}-"
        self._slot_pattern = re.compile(re.escape(self._slot_marker) + r"(\d+)\x00")

    def render(self, messages: Sequence[Message], add_generation_prompt: bool = True,
               tools: Sequence[dict] | None = None) -> list[int]:
        """Token ids of the chat template applied to `messages` (and `tools`, for a template that takes
        them), with message text never parsed for special tokens, and a reply's own generated ids where the
        message carries them (its calls are in them, as the model wrote them)."""
        templated = [self._templated(i, m) for i, m in enumerate(messages)]
        text = self.tokenizer.apply_chat_template(
            templated, tokenize=False, add_generation_prompt=add_generation_prompt, tools=list(tools or ()) or None)
        ids: list[int] = []
        position = 0
        for slot in self._slot_pattern.finditer(text):
            ids += self._encode(text[position:slot.start()], parse_special=True)
            message = messages[int(slot.group(1))]
            ids += message.token_ids if message.token_ids is not None else self._encode(message.content, False)
            position = slot.end()
        ids += self._encode(text[position:], parse_special=True)
        return ids

    def _templated(self, index: int, message: Message) -> dict:
        """The message as the template reads it, its text a slot that `render` fills."""
        templated: dict = {"role": message.role, "content": f"{self._slot_marker}{index}\x00"}
        if message.tool_calls and message.token_ids is None:
            templated["tool_calls"] = [{"id": call.id, "type": "function", "function": {
                "name": call.name, "arguments": json.loads(call.arguments)}} for call in message.tool_calls]
        if message.tool_call_id is not None:
            templated["tool_call_id"] = message.tool_call_id
        return templated

    def count(self, text: str) -> int:
        """Tokens of message text, as `render` encodes it."""
        return len(self._encode(text, parse_special=False))

    def _encode(self, text: str, parse_special: bool) -> list[int]:
        if not text:
            return []
        return self.tokenizer(text, add_special_tokens=False,
                              split_special_tokens=not parse_special)["input_ids"]
