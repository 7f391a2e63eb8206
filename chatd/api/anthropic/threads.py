"""Anthropic message threads (the SDK's tool runner sends them by default): a thread is a chatd session.

A `create` carries the whole conversation, `system` and `tools`; its reply is held under the reply's id
(`sessions/threads.py`). A `continue` names that id and sends only what is new (a user message, or the results of
the reply's calls): it runs as the next turn of the held reply's session, whose history is in the cache, so only
the new messages are prefilled; `system` and `tools` are the thread's. A held reply is continued once; a continue
that fails or is cut holds nothing and leaves the id usable. Errors carry `error.details.error_code` as the SDK
reads them (it replays the history under a new thread after `thread_not_found`, `thread_already_continued` and
`thread_continue_in_flight`, and goes on unthreaded after `thread_unsupported_request`), never with a status the
SDK retries.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from dataclasses import dataclass

from chatd.api.anthropic.messages_schema import MessagesRequest, ThreadContinue, ToolParam
from chatd.api.conversations import Conversations
from chatd.api.http_errors import ApiError
from chatd.api.tool_calling import ToolSetup
from chatd.engine.turn import TurnResult
from sessions import Message, Session, StoreUnavailable
from sessions.threads import ThreadReply, ThreadStore


def thread_error(status: int, error_code: str, message: str, **details: object) -> ApiError:
    """A thread error as Anthropic's API answers it."""
    return ApiError(status, message, param="thread", code=error_code, details={"error_code": error_code, **details})


@dataclass
class Continuation:
    """A continue, resolved: the held reply it continues (claimed: no other continue runs from it), its session's
    history up to that reply, and the thread's system prompt and tools."""

    previous: ThreadReply
    session: Session
    history: list[Message]


class Threads:
    """Holds replies and resolves continues, for the Messages route; counts what happened for /metrics."""

    def __init__(self, store: ThreadStore, conversations: Conversations):
        self.store, self.conversations = store, conversations
        self.counts: Counter[str] = Counter()  # created, continued, not_found
        self._renewals: dict[str, asyncio.Task] = {}  # a claimed reply's id -> the task renewing its claim

    @staticmethod
    def refuse_unsupported(body: MessagesRequest) -> None:
        """What a thread cannot carry, as `thread_unsupported_request` (the SDK then goes on unthreaded)."""
        unsupported = [f"{param.role}_message" for param in body.messages if param.role == "system"]
        if unsupported:
            raise thread_error(400, "thread_unsupported_request", "a system message (tool additions or removals) "
                               "cannot continue a thread here; send the conversation whole", unsupported=unsupported)

    async def resolve(self, owner: str | None, scope: str | None, body: MessagesRequest) -> Continuation:
        """The held reply `body.thread` continues, claimed, and what the new turn runs on; a thread error otherwise.
        `system` and `tools` may be sent again only as the thread has them."""
        thread = body.thread
        assert isinstance(thread, ThreadContinue)
        message_id = thread.previous_message_id
        claim, previous = await self.store.claim(message_id, owner, scope)
        if claim == "continued":
            raise thread_error(400, "thread_already_continued", f"message {message_id!r} was already continued; "
                               "continue from its latest reply, or send the conversation whole")
        if claim == "in_flight":
            raise thread_error(400, "thread_continue_in_flight", f"a continue from message {message_id!r} is "
                               "running; wait for its reply")
        if previous is None:
            self.counts["not_found"] += 1
            raise self._not_found(message_id)
        self._renewals[message_id] = asyncio.create_task(self._renew(message_id))
        try:
            changed = [name for name, sent, held in (("system", body.system_text(), previous.system),
                                                     ("tools", body.tool_definitions(), previous.tools))
                       if name in body.model_fields_set and sent != held]
            if changed:
                raise thread_error(400, "thread_fingerprint_mismatch", f"{' and '.join(changed)} differ from what "
                                   "the thread was created with; a continue takes the thread's (or sends them "
                                   "unchanged)")
            session = await self.conversations.sessions.get(previous.session_id)
            if session is None or session.owner != scope:
                self.counts["not_found"] += 1
                raise self._not_found(previous.message_id)
        except BaseException:
            await self.release(previous)
            raise
        return Continuation(previous, session, session.messages[:previous.messages])

    async def _renew(self, message_id: str) -> None:
        """Renew a claim while its turn runs (a Redis that cannot be reached: the next try, or the lease ends)."""
        while True:
            await asyncio.sleep(self.store.lease_s / 3)
            with contextlib.suppress(StoreUnavailable):
                await self.store.renew(message_id)

    def _claim_ended(self, message_id: str) -> None:
        if (renewal := self._renewals.pop(message_id, None)) is not None:
            renewal.cancel()

    @staticmethod
    def thread_body(body: MessagesRequest, continuation: Continuation) -> MessagesRequest:
        """The request with the thread's system prompt and tools (what its setup, breakpoints and reply read)."""
        previous = continuation.previous
        tools = None if previous.tools is None else [ToolParam(**tool) for tool in previous.tools]
        return body.model_copy(update={"system": previous.system, "tools": tools})

    def setup(self, body: MessagesRequest, continuation: Continuation) -> ToolSetup:
        """The new turn's tools, tool choice and output format; its tool results checked against the thread's calls
        (`RequestRefused` naming what is wrong)."""
        return body.tool_setup(self.conversations.tool_format(), earlier=continuation.history)

    async def settle(self, message_id: str, owner: str | None, scope: str | None, body: MessagesRequest,
                     session: Session, result: TurnResult | None, continued: ThreadReply | None) -> None:
        """A reply that reached its end (`result`): hold it under its id (the session as recorded with it), and mark
        the reply it continued, if any, as continued. One that did not (None, or cancelled) holds nothing, and the
        reply it continued may be continued again."""
        if result is None or result.finish_reason == "cancelled":
            await self.release(continued)
            return
        reply = ThreadReply(message_id, owner, scope, session.session_id, session.version, len(session.messages),
                            body.model, body.system_text(), body.tool_definitions())
        try:
            await self.store.put(reply)
        except StoreUnavailable:
            await self.release(continued)  # (not held: the reply it continued stays continuable)
            raise
        if continued is not None:  # (held first: never a reply marked continued whose successor is not held)
            self._claim_ended(continued.message_id)
            await self.store.settle(continued.message_id, continued=True)
            self.counts["continued"] += 1
        else:
            self.counts["created"] += 1

    async def release(self, continued: ThreadReply | None) -> None:
        """A continue that holds nothing (failed, cut): the reply it continued may be continued again. A Redis that
        cannot be reached now is not the caller's error: the claim's lease then ends on its own."""
        if continued is not None:
            self._claim_ended(continued.message_id)
            with contextlib.suppress(StoreUnavailable):
                await self.store.settle(continued.message_id, continued=False)

    @staticmethod
    def _not_found(message_id: str) -> ApiError:
        return thread_error(404, "thread_not_found", f"thread message {message_id!r} not found (unknown, expired, "
                            "or another key's or cache_salt's); send the conversation whole under a new thread")
