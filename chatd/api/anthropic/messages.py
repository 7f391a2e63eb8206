"""The Anthropic Messages API: `POST /v1/messages`, streamed (server-sent events) or not, and
`POST /v1/messages/count_tokens`.

Like OpenAI's clients, Anthropic's are stateless: each request carries the whole conversation. `Conversations`
finds the session it continues (the same matching as chat completions, owner-scoped: a conversation sent through
either API reaches the same session and cache), and the turn runs through the `TurnRunner` as every turn does.
`cache_control` breakpoints keep the session's cache resident for their ttl ahead of plain LRU; the usage says
which prompt tokens were read from a cache and which a breakpoint newly wrote.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatd.api.admission import Admission
from chatd.api.anthropic.errors import anthropic_body
from chatd.api.anthropic.messages_schema import (
    CacheControl,
    CacheCreation,
    CountTokensRequest,
    ErrorOut,
    MessageOut,
    MessagesRequest,
    StopReason,
    TextOut,
    ThreadContinue,
    TokenCount,
    ToolUseOut,
    Usage,
)
from chatd.api.anthropic.threads import Continuation, Threads
from chatd.api.cache_writes import written_tokens
from chatd.api.constants import ARGUMENTS_FRAGMENT, SESSION_HEADER, WORKER, WORKER_HEADER
from chatd.api.conversations import Conversations, salted
from chatd.api.http_errors import ApiError, refusals, store_call
from chatd.api.tool_calling import RequestRefused, ToolSetup
from chatd.api.turn_errors import ErrorMessage
from chatd.api.turns import MOVED_ON, StartedTurn, TurnPlan, TurnRequest, TurnRunner
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TurnFailed, TurnResult
from sessions import Message, Session, ToolCall

MAX_BREAKPOINTS = 4  # as Anthropic's API: at most four blocks with cache_control


class AnthropicApi:
    """The Messages routes over the turn runner."""

    def __init__(self, admission: Admission, conversations: Conversations, turns: TurnRunner, threads: Threads):
        self.admission, self.conversations, self.turns, self.threads = admission, conversations, turns, threads
        self.router = APIRouter(prefix="/v1")
        errors = {code: {"model": ErrorOut} for code in (400, 401, 404, 429, 529)}
        self.router.add_api_route("/messages", self.create, methods=["POST"], response_model=MessageOut,
                                  responses=errors)
        self.router.add_api_route("/messages/count_tokens", self.count_tokens, methods=["POST"],
                                  response_model=TokenCount, responses=errors)

    async def count_tokens(self, request: Request, body: CountTokensRequest) -> Response:
        """The prompt's tokens, as `/v1/messages` renders the same conversation (tools included)."""
        self.admission.authenticate(request)
        with refusals():
            body.refuse_unsupported()
        self.admission.check_model(body.model)
        self.admission.refuse_when_unavailable()  # (the tokenizer comes with the model)
        with refusals():
            setup = body.tool_setup(self.conversations.tool_format())
        system, history, content = body.conversation()
        ids = self.conversations.render(system, history, content, setup)
        return JSONResponse(TokenCount(input_tokens=len(ids)).model_dump())

    async def create(self, request: Request, body: MessagesRequest,
                     x_session_id: Annotated[str | None, Header()] = None) -> Response:
        owner, max_new_tokens = self.admission.open(request, body, body.max_tokens)
        if body.thread is not None:
            Threads.refuse_unsupported(body)
        client = owner or (request.client.host if request.client else "unknown")
        scope = salted(owner, body.cache_salt)
        continuation = None
        if isinstance(body.thread, ThreadContinue):
            continuation = await store_call(self.threads.resolve(owner, scope, body))
            body = Threads.thread_body(body, continuation)
        try:
            return await self._reply(body, owner, scope, client, max_new_tokens, x_session_id, continuation)
        except BaseException:
            if continuation is not None:
                await self.threads.release(continuation.previous)
            raise

    async def _reply(self, body: MessagesRequest, owner: str | None, scope: str | None, client: str,
                     max_new_tokens: int, hint: str | None, continuation: Continuation | None) -> Response:
        """The turn and its reply, streamed or whole; with a thread, the reply held once it has reached its end."""
        with refusals():
            setup = self.threads.setup(body, continuation) if continuation is not None else \
                body.tool_setup(self.conversations.tool_format())
            marks = body.breakpoints()
            if len(marks) > MAX_BREAKPOINTS:
                raise RequestRefused("cache_control", f"at most {MAX_BREAKPOINTS} blocks may have cache_control, "
                                                      f"not {len(marks)}")
            ttls = [control.ttl for _, control in marks]
            if "5m" in ttls and "1h" in ttls[ttls.index("5m"):]:  # (as Anthropic's: the longer-lived prefix first)
                raise RequestRefused("cache_control", "a cache_control with ttl 1h must come before any with ttl 5m")
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=body.temperature,
                                top_p=body.top_p or 1.0, top_k=body.top_k, stop=list(body.stop_sequences or []),
                                grammar=await self.admission.compile(setup, "output_config.format"))
        message_id = "msg_" + secrets.token_hex(12)
        ttl = max((control.seconds for _, control in marks), default=None)
        if continuation is not None:
            session, started = await self._continue(continuation, body, scope, client, params, message_id, setup,
                                                    ttl)
        else:
            system, history, content = body.conversation()
            session, started = await self.conversations.start(
                scope, client, system, history, content, body.session_id or hint,
                TurnPlan(content, params, setup, keep_for_s=ttl), message_id, "anthropic")
        started.parse = _anthropic_reader(started.parse)
        first, events = await self.conversations.relay(scope, started)
        headers = {SESSION_HEADER: session.session_id, WORKER_HEADER: WORKER}
        settle = None
        if body.thread is not None:
            previous = continuation.previous if continuation is not None else None

            async def settle(result: TurnResult | None) -> None:
                await store_call(self.threads.settle(message_id, owner, scope, body, started.session, result,
                                                     previous))

        reply = _Reply(message_id, body.model, self._last_breakpoint(body, marks, setup),
                       self._last_breakpoint(body, [mark for mark in marks if mark[1].ttl == "1h"], setup))
        if body.stream:
            return StreamingResponse(reply.stream(started, first, events, setup, settle),
                                     media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        result = await self.conversations.result(first, events)
        if settle is not None:
            await settle(result)
        return JSONResponse(reply.message(result, *started.reply).model_dump(), headers=headers)

    async def _continue(self, continuation: Continuation, body: MessagesRequest, scope: str | None, client: str,
                        params: SamplingParams, message_id: str, setup: ToolSetup, ttl: float | None
                        ) -> tuple[Session, StartedTurn]:
        """The continue's turn: the next turn of the held reply's session when that reply is still its latest point
        (only the new messages are prefilled), else of a branch from that point (its cache a copy of the part they
        share)."""
        session, previous, new = continuation.session, continuation.previous, body.new_messages()
        plan = TurnPlan(new, params, setup, keep_for_s=ttl)
        if session.version == previous.version and not self.turns.is_claimed(session.session_id):
            started = await self.turns.start(TurnRequest(session.session_id, message_id, scope, client, "anthropic",
                                                         plan, expected_version=previous.version))
            if not isinstance(started, ErrorMessage):
                return session, started
            if started.code not in MOVED_ON:
                raise ApiError.of(started)
        # (moved on since, or running here or on another worker: a branch from the held reply's point)
        history = continuation.history
        ids = self.conversations.render(previous.system, history, new, setup)
        branch = await self.conversations.branch(scope, previous.system, history, ids, [(session, history, ids)])
        started = await self.turns.start(TurnRequest(branch.session_id, message_id, scope, client, "anthropic", plan))
        if isinstance(started, ErrorMessage):
            raise ApiError.of(started)
        return branch, started

    def _last_breakpoint(self, body: MessagesRequest, marks: list[tuple[int, CacheControl]], setup: ToolSetup
                         ) -> list[int] | None:
        """What `cache_creation_input_tokens` counts up to: the last breakpoint, the others being within it. None
        when it ends the last message (the whole prompt; nothing to render); else the ids of the conversation up to
        its block (the tools and the system prompt, or a message), as far as the prompt begins with them; [] without
        a breakpoint."""
        index = max((index for index, _ in marks), default=None)
        if index is None:
            return []
        if index == len(body.messages) - 1:
            return None
        system = body.system_text()
        upto = [message for param in body.messages[:index + 1] for message in param.messages()] or \
            [Message("user", "")]
        return self.conversations.render(system, upto[:-1], upto[-1:], setup)


class _Reply:
    """One reply in Anthropic's shapes: the message, or its stream of events."""

    def __init__(self, message_id: str, model: str, breakpoint: list[int] | None, hour_breakpoint: list[int] | None):
        self.message_id, self.model = message_id, model
        self.breakpoint, self.hour_breakpoint = breakpoint, hour_breakpoint  # (`_last_breakpoint`: all, 1h ones)

    def usage(self, prompt_ids: list[int], read: int, output_tokens: int) -> Usage:
        """The prompt's tokens read from a cache, newly written up to the last breakpoint (those up to the last 1h
        breakpoint apart from the 5m ones), and the rest."""
        written = written_tokens(prompt_ids, read, self.breakpoint)
        hour = min(written, written_tokens(prompt_ids, read, self.hour_breakpoint))
        return Usage(input_tokens=len(prompt_ids) - read - written, output_tokens=output_tokens,
                     cache_read_input_tokens=read, cache_creation_input_tokens=written,
                     cache_creation=CacheCreation(ephemeral_5m_input_tokens=written - hour,
                                                  ephemeral_1h_input_tokens=hour))

    def result_usage(self, result: TurnResult) -> Usage:
        return self.usage(result.conversation_ids[:result.prompt_tokens], result.cached_tokens,
                          result.completion_tokens)

    def message(self, result: TurnResult, text: str, calls: list[ToolCall]) -> MessageOut:
        content: list[TextOut | ToolUseOut] = [TextOut(text=text)] if text or not calls else []
        content += [ToolUseOut(id=call.id, name=call.name, input=_input(call)) for call in calls]
        return MessageOut(id=self.message_id, model=self.model, content=content,
                          stop_reason=_stop_reason(result, calls), stop_sequence=result.stop_sequence,
                          usage=self.result_usage(result))

    async def stream(self, started: StartedTurn, first: str | TurnResult, events: asyncio.Queue,
                     setup: ToolSetup, settle: Callable[[TurnResult | None], Awaitable[None]] | None = None
                     ) -> AsyncIterator[str]:
        """Anthropic's events: `message_start` (with the prompt's usage: the prompt is prefilled by the first
        token), a text block when the reply has text or no call (`content_block_start`, `text_delta`s,
        `content_block_stop`), one block per call (its `input_json_delta`s), `message_delta` with the stop reason
        and the usage, `message_stop`. Text from where the model opens a call on is held back and sent as calls
        once the reply is read. A client that goes away cancels the turn. With `settle` (a thread), the reply is
        held before `message_stop` (one that cannot be held ends the stream with an `error` event instead), and a
        stream cut before it holds nothing (`settle(None)`)."""
        event, prose = first, setup.prose_stream()
        read = started.turn.prompt_read
        usage = self.result_usage(event) if isinstance(event, TurnResult) else \
            self.usage(read.prompt_ids, read.cached_tokens, 0) if read is not None else Usage(input_tokens=0,
                                                                                               output_tokens=0)
        start = MessageOut(id=self.message_id, model=self.model, content=[], stop_reason=None, usage=usage)
        text_open = False  # (the text block opens with the first text: a reply of calls alone has none)
        held = False
        try:
            yield _sse("message_start", {"type": "message_start", "message": start.model_dump()})
            yield _sse("ping", {"type": "ping"})
            while isinstance(event, str):
                if text := prose.push(event):
                    if not text_open:
                        yield _TEXT_BLOCK_START
                        text_open = True
                    yield _text_delta(text)
                event = await events.get()
            if isinstance(event, TurnFailed):
                yield _sse("error", anthropic_body(ApiError.of(event)).model_dump(exclude_none=True))
                return
            text, calls = started.reply
            rest = prose.rest(text, bool(calls) or prose.opened)
            if not text_open and (rest or not calls):
                yield _TEXT_BLOCK_START
                text_open = True
            if rest:
                yield _text_delta(rest)
            if text_open:
                yield _sse("content_block_stop", {"type": "content_block_stop", "index": 0})
            for block in _tool_use_blocks(calls, first_index=int(text_open)):
                yield block
            yield _sse("message_delta", {"type": "message_delta", "delta": {
                "stop_reason": _stop_reason(event, calls), "stop_sequence": event.stop_sequence},
                "usage": self.result_usage(event).model_dump()})
            if settle is not None:  # held before `message_stop`, shielded: a client leaving cannot cut it halfway
                held = True
                try:
                    await asyncio.shield(settle(event))
                except ApiError as error:  # (Redis could not hold it: the SDK sees an error, not a broken stream)
                    yield _sse("error", anthropic_body(error).model_dump(exclude_none=True))
                    return
            yield _sse("message_stop", {"type": "message_stop"})
        finally:
            if isinstance(event, str):  # the client left mid-stream
                started.turn.cancel()
            if settle is not None and not held:  # (shielded: a client that left cancels this task)
                await asyncio.shield(settle(None))


def _tool_use_blocks(calls: list[ToolCall], first_index: int) -> Iterator[str]:
    """One `tool_use` block per call: its start, its arguments as `input_json_delta` fragments, its stop."""
    for index, call in enumerate(calls, start=first_index):
        yield _sse("content_block_start", {"type": "content_block_start", "index": index, "content_block": {
            "type": "tool_use", "id": call.id, "name": call.name, "input": {}}})
        arguments = json.dumps(_input(call), ensure_ascii=False)
        for start in range(0, len(arguments), ARGUMENTS_FRAGMENT):
            yield _sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": {
                "type": "input_json_delta", "partial_json": arguments[start:start + ARGUMENTS_FRAGMENT]}})
        yield _sse("content_block_stop", {"type": "content_block_stop", "index": index})


def _sse(name: str, data: dict) -> str:
    return f"event: {name}\ndata: {json.dumps(data, ensure_ascii=False)}\n\n"


_TEXT_BLOCK_START = _sse("content_block_start", {"type": "content_block_start", "index": 0,
                                                 "content_block": {"type": "text", "text": ""}})


def _text_delta(text: str) -> str:
    return _sse("content_block_delta", {"type": "content_block_delta", "index": 0,
                                        "delta": {"type": "text_delta", "text": text}})


def _stop_reason(result: TurnResult, calls: list[ToolCall]) -> StopReason:
    if calls:
        return "tool_use"
    if result.finish_reason == "length":
        return "max_tokens"
    return "stop_sequence" if result.stop_sequence is not None else "end_turn"


def _input(call: ToolCall) -> dict:
    """A call's arguments as the object Anthropic's `input` is (the grammar held them to JSON)."""
    try:
        arguments = json.loads(call.arguments)
    except ValueError:
        return {}
    return arguments if isinstance(arguments, dict) else {}


def _anthropic_reader(parse):
    """A reply's reader whose calls carry Anthropic's `toolu_` ids (recorded so: the client sends them back)."""

    def read(text: str) -> tuple[str, list[ToolCall]]:
        prose, calls = parse(text)
        return prose, [ToolCall("toolu_" + call.id.removeprefix("call_"), call.name, call.arguments)
                       for call in calls]

    return read

