"""Turn generated token ids into streamed text, honouring stop strings.

Decoding one token at a time breaks multi-byte characters and merged spaces, so text is decoded
over a short window of recent tokens and only stable text is released. Text that could be the
start of a stop string is held back until it is known not to be one.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PreTrainedTokenizerBase


class TextStream:
    """Turns generated ids into released text, holding back what could still become a stop string."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, stop: Sequence[str] = ()):
        self._tokenizer = tokenizer
        self._stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self._stop), default=1) - 1
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self.text = ""
        self._released = 0
        self.stopped = False
        self.stop_sequence: str | None = None  # the stop string that ended the text, once one did

    def push(self, token_id: int) -> str:
        """Add one generated token; return the text that may be shown now (possibly empty)."""
        self._ids.append(token_id)
        before = self.decode(self._ids[self._prefix_offset:self._read_offset])
        after = self.decode(self._ids[self._prefix_offset:])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self.text += after[len(before):]
            self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return self._release(final=False)

    def finish(self) -> str:
        """Release whatever text is still held back at the end of the turn."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        if self._stop and not self.stopped:
            search_from = max(0, self._released - self._holdback)
            hits = [(at, stop) for stop in self._stop if (at := self.text.find(stop, search_from)) >= 0]
            if hits:
                at, self.stop_sequence = min(hits)
                self.text = self.text[:at]
                self.stopped = True
        end = len(self.text) if final or self.stopped else max(self._released, len(self.text) - self._holdback)
        released, self._released = self.text[self._released:end], end
        return released

    def decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True) if ids else ""
