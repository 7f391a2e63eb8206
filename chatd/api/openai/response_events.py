"""A response's typed events, as the `openai` SDK parses them from the HTTP stream (server-sent events) and from the
WebSocket mode (one JSON object per text frame): the same events, whichever transport carries them."""

from __future__ import annotations

from collections.abc import AsyncIterator

from chatd.api.constants import ARGUMENTS_FRAGMENT
from chatd.api.openai.response_turns import OpenedResponse, ResponseEvent, finished
from chatd.api.openai.responses_schema import OutputFunctionCall, OutputMessage, OutputText, ResponseError
from chatd.engine.turn import TurnFailed


async def response_events(opened: OpenedResponse, first: ResponseEvent | None = None) -> AsyncIterator[dict]:
    """The response's events: created and in progress, the reply's message item as its text comes (text from where
    the model opens a call on is held back), then each call as a function_call item with its arguments in fragments,
    then how it ended (completed, incomplete, failed). `first`: its first turn event, if already taken from its
    queue. A consumer that stops early (a client gone) cancels the turn."""
    created, started, setup, events = opened.created, opened.started, opened.setup, opened.events
    events_of = ResponseEvents("msg_" + created.id[5:])
    event, opened_message = first, False
    prose = setup.prose_stream()
    try:
        yield events_of("response.created", response=created.model_dump())
        yield events_of("response.in_progress", response=created.model_dump())
        if event is None:
            event = await events.get()
        while isinstance(event, str):
            if text := prose.push(event):
                if not opened_message:
                    for opening in events_of.message_opened():
                        yield opening
                    opened_message = True
                yield events_of.text_delta(text)
            event = await events.get()
        if isinstance(event, TurnFailed):
            failed = created.model_copy(update={"status": "failed",
                                                "error": ResponseError(code=event.code, message=event.message)})
            yield events_of("response.failed", response=failed.model_dump())
            return
        done = finished(created, event, started.reply, opened.cache)
        items = list(done.output)
        if not opened_message and items and isinstance(items[0], OutputMessage):
            for opening in events_of.message_opened():
                yield opening
            opened_message = True
        if rest := prose.rest(started.reply[0], bool(started.reply[1]) or prose.opened):
            yield events_of.text_delta(rest)
        if opened_message:
            for closing in events_of.message_done(items.pop(0)):
                yield closing
        for index, call in enumerate(items, start=1 if opened_message else 0):
            for part in events_of.function_call(index, call):
                yield part
        yield events_of("response.completed" if done.status == "completed" else "response.incomplete",
                        response=done.model_dump())
    finally:
        if isinstance(event, str) or event is None:  # the client left mid-stream
            started.turn.cancel()


class ResponseEvents:
    """A response's events, numbered in the order they are made; the message item is `message_id`."""

    def __init__(self, message_id: str):
        self.message_id, self.sequence = message_id, 0

    def __call__(self, kind: str, **fields) -> dict:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def text_delta(self, text: str) -> dict:
        """A piece of the reply's text."""
        return self("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                    delta=text, logprobs=[])

    def message_opened(self) -> list[dict]:
        """The reply's message item and its text part, opened."""
        item = OutputMessage(id=self.message_id, status="in_progress", content=[]).model_dump()
        return [self("response.output_item.added", output_index=0, item=item),
                self("response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
                     part=OutputText(text="").model_dump())]

    def message_done(self, message: OutputMessage) -> list[dict]:
        """The reply's text, its part and its item, done."""
        return [self("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                     text=message.content[0].text, logprobs=[]),
                self("response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
                     part=message.content[0].model_dump()),
                self("response.output_item.done", output_index=0, item=message.model_dump())]

    def function_call(self, index: int, call: OutputFunctionCall) -> list[dict]:
        """A call as the SDK assembles it: the item, its arguments in fragments, their end, the item's end."""
        events = [self("response.output_item.added", output_index=index,
                       item=call.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump())]
        for start in range(0, len(call.arguments), ARGUMENTS_FRAGMENT):
            events.append(self("response.function_call_arguments.delta", item_id=call.id, output_index=index,
                               delta=call.arguments[start:start + ARGUMENTS_FRAGMENT]))
        events.append(self("response.function_call_arguments.done", item_id=call.id, output_index=index,
                           name=call.name, arguments=call.arguments))
        events.append(self("response.output_item.done", output_index=index, item=call.model_dump()))
        return events
