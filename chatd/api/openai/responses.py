"""OpenAI's Responses API (`/v1/responses`) and Conversations API (`/v1/conversations`) over chatd sessions.

The Responses API is stateful: a response is stored, and the next request sends only its new input (a user
message, or the outputs of the functions the response called) with `previous_response_id`, or names a
`conversation`. A stored response is a point in a chatd session, so
continuing from the session's latest response is a session turn resumed from its cache (only the new
input is prefilled, no prefix matching at all); continuing from an earlier one branches a new session from
that point (its cache a copy of the shared part), so regenerate and edit work. A conversation is a
session. Without either, a request is matched like a chat completion (the prefix index): the Agents SDK
resends a run's items, and its next round continues the session the last one left. Turns run through the
same `TurnRunner`, tools, grammars, keys, limits, leases and metrics as the other APIs.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatd.api.admission import Admission
from chatd.api.constants import ARGUMENTS_FRAGMENT, SESSION_HEADER, WORKER, WORKER_HEADER
from chatd.api.conversations import Conversations, salted
from chatd.api.http_errors import ApiError, refusals, store_call
from chatd.api.openai.responses_schema import (
    ConversationCreate,
    ConversationDeleted,
    ConversationObject,
    ConversationRef,
    IncompleteDetails,
    InputItem,
    InputTokensDetails,
    ItemList,
    ListedFunctionOutput,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseDeleted,
    ResponseError,
    ResponseObject,
    ResponseRequest,
    ResponseUsage,
)
from chatd.api.tool_calling import ToolSetup
from chatd.api.turn_errors import ErrorMessage
from chatd.api.turns import StartedTurn
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TurnFailed, TurnResult
from sessions import Message, Session, StoreUnavailable, ToolCall
from sessions.responses import ConversationInfo, ResponseStore, StoredResponse

DEFAULT_MAX_OUTPUT_TOKENS = 256


class ResponsesApi:
    """The Responses and Conversations routes, sharing the OpenAI API's authentication, matching and turns."""

    def __init__(self, admission: Admission, conversations: Conversations, store: ResponseStore):
        self.admission, self.conversations, self.store = admission, conversations, store
        self.sessions, self.turns, self.engine = conversations.sessions, conversations.turns, conversations.engine
        errors = {code: {"model": dict} for code in (400, 401, 404, 409, 429, 503)}
        self.router = APIRouter(prefix="/v1")
        self.router.add_api_route("/responses", self.create, methods=["POST"], responses=errors)
        self.router.add_api_route("/responses/{response_id}", self.retrieve, methods=["GET"])
        self.router.add_api_route("/responses/{response_id}", self.delete, methods=["DELETE"])
        self.router.add_api_route("/responses/{response_id}/input_items", self.input_items, methods=["GET"])
        self.router.add_api_route("/conversations", self.create_conversation, methods=["POST"])
        self.router.add_api_route("/conversations/{conversation_id}", self.retrieve_conversation, methods=["GET"])
        self.router.add_api_route("/conversations/{conversation_id}", self.delete_conversation, methods=["DELETE"])
        self.router.add_api_route("/conversations/{conversation_id}/items", self.conversation_items, methods=["GET"])

    # ##### Responses #####

    async def create(self, request: Request, body: ResponseRequest) -> Response:
        owner = self.admission.authenticate(request)
        with refusals():
            body.refuse_unsupported()
            setup = body.tool_setup(self.conversations.tool_format())
            if not body.previous_response_id and not body.conversation_id():
                body.check_outputs()  # otherwise against the history, once it is read
        self.admission.check_model(body.model)
        max_new_tokens = self.admission.max_new_tokens(body.max_output_tokens, DEFAULT_MAX_OUTPUT_TOKENS,
                                                       "max_output_tokens")
        self.admission.refuse_when_unavailable()
        client = owner or (request.client.host if request.client else "unknown")
        scope = salted(owner, body.cache_salt)  # whose sessions and caches (the stored response stays the key's)
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                                grammar=await self.admission.compile(setup, "text.format"))
        created = ResponseObject(id="resp_" + secrets.token_hex(16), created_at=int(time.time()), status="in_progress",
                                 model=body.model, instructions=body.instructions,
                                 previous_response_id=body.previous_response_id,
                                 conversation=ConversationRef(id=cid) if (cid := body.conversation_id()) else None,
                                 metadata=body.metadata or {}, user=body.user, store=body.store,
                                 temperature=body.temperature, top_p=body.top_p,
                                 max_output_tokens=body.max_output_tokens, tools=body.tools or [],
                                 tool_choice=body.tool_choice or "auto",
                                 parallel_tool_calls=body.parallel_tool_calls is not False,
                                 text=body.text or {"format": {"type": "text"}})
        try:
            session, started = await self._start(owner, scope, body, params, created.id, client, setup)
        except StoreUnavailable as error:
            raise ApiError(503, f"{error}; try again shortly", code="unavailable") from None
        if isinstance(started, ErrorMessage):
            if not body.store:
                await self._forget(session.session_id)
            raise ApiError.of(started)
        events: asyncio.Queue[str | TurnResult | TurnFailed] = asyncio.Queue()
        self.turns.forward(started, events.put,
                           lambda event: self._ended(owner, scope, body, created, started, event, events))
        event = await events.get()  # a turn that fails before its first token gets its own status code
        if isinstance(event, TurnFailed):
            raise ApiError.of(event)
        headers = {SESSION_HEADER: session.session_id, WORKER_HEADER: WORKER}
        if body.stream:
            return StreamingResponse(self._stream(started, created, event, events, setup),
                                     media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        while isinstance(event, str):
            event = await events.get()
        if isinstance(event, TurnFailed):
            raise ApiError.of(event)
        return JSONResponse(_finished(created, event, started.reply).model_dump(), headers=headers)

    async def retrieve(self, request: Request, response_id: str) -> Response:
        stored = await self._stored(request, response_id)
        return JSONResponse(stored.body)

    async def delete(self, request: Request, response_id: str) -> Response:
        await self._stored(request, response_id)
        await store_call(self.store.delete(response_id))
        return JSONResponse(ResponseDeleted(id=response_id).model_dump())

    async def input_items(self, request: Request, response_id: str) -> Response:
        stored = await self._stored(request, response_id)
        items = [_listed_input(f"{response_id[5:]}_{index}", item) for index, item in enumerate(stored.input)]
        return JSONResponse(_item_list(items).model_dump())

    # ##### Conversations #####

    async def create_conversation(self, request: Request, body: ConversationCreate) -> Response:
        owner = self.admission.authenticate(request)
        messages = [item.message() for item in body.items or []]
        system = messages[0].content if messages and messages[0].role == "system" else None
        history = messages[1:] if system is not None else messages
        if any(m.role == "system" for m in history):
            raise ApiError(400, "a system or developer item may only come first", param="items", code="bad_request")
        session = await store_call(self.sessions.create(system, owner=owner, messages=history))
        info = ConversationInfo(session.session_id, owner, int(time.time()), body.metadata or {})
        await store_call(self.store.put_conversation(info))
        return JSONResponse(_conversation(info).model_dump())

    async def retrieve_conversation(self, request: Request, conversation_id: str) -> Response:
        info, _ = await self._conversation(request, conversation_id)
        return JSONResponse(_conversation(info).model_dump())

    async def delete_conversation(self, request: Request, conversation_id: str) -> Response:
        _, session = await self._conversation(request, conversation_id)
        if running := self.turns.turn_of(session.session_id):
            running.cancel()
        await store_call(self.sessions.delete(session.session_id))
        await store_call(self.store.delete_conversation(conversation_id))
        self.engine.close_session(session.session_id)
        await self.conversations.index.remove(session.session_id)
        return JSONResponse(ConversationDeleted(id=conversation_id).model_dump())

    async def conversation_items(self, request: Request, conversation_id: str) -> Response:
        _, session = await self._conversation(request, conversation_id)
        messages = ([Message("system", session.system)] if session.system is not None else []) + session.messages
        items = [item for index, message in enumerate(messages)
                 for item in _listed_message(f"{conversation_id}_{index}", message)]
        return JSONResponse(_item_list(items).model_dump())

    # ##### Where a response runs #####

    async def _start(self, owner: str | None, scope: str | None, body: ResponseRequest, params: SamplingParams,
                     response_id: str, client: str, setup: ToolSetup) -> tuple[Session, StartedTurn | ErrorMessage]:
        """The session the response runs in, claimed, and its turn started (or why not). `owner`: the key's id;
        `scope`: whose sessions and caches (the key's, or its `cache_salt`'s)."""
        extra, new = body.split()
        if conversation_id := body.conversation_id():
            if extra or not body.store:
                raise ApiError(400, "a response in a conversation takes only new input (a user message or function "
                                    "call outputs) and is stored", param="input" if extra else "store",
                               code="bad_request")
            _, session = await self._owned_conversation(owner, conversation_id)
            with refusals():
                body.check_outputs(_call_ids(session.messages))
            if not self.turns.try_claim(session.session_id):
                raise ApiError(409, f"a response of conversation {conversation_id!r} is running; wait for it",
                               param="conversation", code="conflict")
            return session, await self.conversations.begin(session, new, params, response_id, scope, client,
                                                    api="responses", setup=setup)
        system = body.instructions
        if body.previous_response_id:
            session, fresh = await self._from_previous(owner, scope, body, extra, new, setup)
        else:
            if extra and extra[0].role == "system":
                system, extra = (extra[0].content if system is None else system), extra[1:]
            session, _, matched = await self.conversations.place(scope, system, extra, new, None, setup)
            fresh = not matched
        if not body.store and not fresh:
            # Nothing may be left behind: the turn runs in a session of its own, deleted after the reply.
            self.turns.release_claim(session.session_id)
            session = await self.conversations.branch_from(scope, session.system, session.messages, new, session, setup)
            fresh = True
        started = await self.conversations.begin(session, new, params, response_id, scope, client,
                                          expected_version=None if fresh else session.version, api="responses",
                                          setup=setup)
        if isinstance(started, ErrorMessage) and started.code in ("busy", "conflict") and not fresh:
            # Another worker runs or ran a turn of that session meanwhile: this response branches from its point.
            if body.previous_response_id:
                session, _ = await self._from_previous(owner, scope, body, extra, new, setup, branch=True)
            else:
                session = await self.conversations.branch_from(scope, system, extra, new, session, setup)
            started = await self.conversations.begin(session, new, params, response_id, scope, client,
                                              api="responses", setup=setup)
        return session, started

    async def _from_previous(self, owner: str | None, scope: str | None, body: ResponseRequest, extra: list[Message],
                             new: list[Message], setup: ToolSetup, branch: bool = False) -> tuple[Session, bool]:
        """The session that continues `previous_response_id`, claimed, and whether it is new: its own when
        that response is its latest point and nothing is added before the new input (unless `branch`);
        otherwise a branch from that point. A previous response of another `cache_salt` is not found."""
        previous = await store_call(self.store.get(body.previous_response_id))
        if previous is None or previous.owner != owner:
            raise ApiError(404, f"previous response {body.previous_response_id!r} not found",
                           param="previous_response_id", code="previous_response_not_found")
        session = await store_call(self.sessions.get(previous.session_id))
        if session is None or session.owner != scope:
            raise ApiError(404, f"previous response {body.previous_response_id!r} not found (its conversation "
                                "expired, or it was made with another cache_salt)", param="previous_response_id",
                           code="previous_response_not_found")
        with refusals():
            body.check_outputs(_call_ids(session.messages[:previous.messages]))
        system = body.instructions if body.instructions is not None else session.system
        if not branch and session.version == previous.version and not extra and system == session.system and \
                self.turns.try_claim(session.session_id):
            return session, False
        history = session.messages[:previous.messages] + extra
        ids = self.conversations.render(system, history, new, setup)
        return await self.conversations.branch(scope, system, history, ids, [(session, history, ids)]), True

    async def _ended(self, owner: str | None, scope: str | None, body: ResponseRequest, created: ResponseObject,
                     started: StartedTurn, event: TurnResult | TurnFailed, events: asyncio.Queue) -> None:
        """The turn is recorded (or failed): store the response and index the conversation (or, for
        `store: false`, forget its session), then hand over the end."""
        session = started.session
        if not body.store:
            await self._forget(session.session_id)
        elif isinstance(event, TurnResult) and event.finish_reason != "cancelled":
            stored = StoredResponse(created.id, owner, session.session_id, session.version,  # (the turn is recorded)
                                    len(session.messages),
                                    _finished(created, event, started.reply).model_dump(), body.input_record())
            try:
                await self.store.put(stored)
                conversation_id = body.conversation_id()
                if conversation_id and (info := await self.store.get_conversation(conversation_id)) is not None:
                    await self.store.put_conversation(info)  # its retention renewed with its session's
            except StoreUnavailable:
                event = TurnFailed("unavailable", "the reply could not be stored; send the input again")
            else:
                await self.conversations.ended(scope, session.session_id, event)
        await events.put(event)

    async def _forget(self, session_id: str) -> None:
        """A `store: false` response's session: gone once the reply is sent."""
        try:
            await self.sessions.delete(session_id)
        except StoreUnavailable:
            pass  # it expires with the retention
        self.engine.close_session(session_id)

    async def _stream(self, started: StartedTurn, created: ResponseObject, first: str | TurnResult,
                      events: asyncio.Queue, setup: ToolSetup) -> AsyncIterator[str]:
        """The typed server-sent events the `openai` SDK parses: the reply's message item as its text comes
        (text from where the model opens a call on is held back), then each call as a function_call item with
        its arguments in fragments. A client that goes away cancels the turn."""
        sse = _ResponseEvents("msg_" + created.id[5:])
        event, opened = first, False
        prose = setup.prose_stream()
        try:
            yield sse("response.created", response=created.model_dump())
            yield sse("response.in_progress", response=created.model_dump())
            while isinstance(event, str):
                if text := prose.push(event):
                    if not opened:
                        yield sse.message_opened()
                        opened = True
                    yield sse.text_delta(text)
                event = await events.get()
            if isinstance(event, TurnFailed):
                failed = created.model_copy(update={"status": "failed",
                                                    "error": ResponseError(code=event.code, message=event.message)})
                yield sse("response.failed", response=failed.model_dump())
                return
            finished = _finished(created, event, started.reply)
            if not opened and isinstance(finished.output[0], OutputMessage):
                yield sse.message_opened()
                opened = True
            if rest := prose.rest(started.reply[0], bool(started.reply[1])):
                yield sse.text_delta(rest)
            if opened:
                yield sse.message_done(finished.output[0])
            for index, call in enumerate(finished.output[1 if opened else 0:], start=1 if opened else 0):
                yield sse.function_call(index, call)
            yield sse("response.completed" if finished.status == "completed" else "response.incomplete",
                      response=finished.model_dump())
        finally:
            if isinstance(event, str):  # the client left mid-stream
                started.turn.cancel()

    # ##### Lookups #####

    async def _stored(self, request: Request, response_id: str) -> StoredResponse:
        owner = self.admission.authenticate(request)
        stored = await store_call(self.store.get(response_id))
        if stored is None or stored.owner != owner:
            raise ApiError(404, f"response {response_id!r} not found", param="response_id", code="not_found")
        return stored

    async def _conversation(self, request: Request, conversation_id: str) -> tuple[ConversationInfo, Session]:
        return await self._owned_conversation(self.admission.authenticate(request), conversation_id)

    async def _owned_conversation(self, owner: str | None, conversation_id: str
                                  ) -> tuple[ConversationInfo, Session]:
        info = await store_call(self.store.get_conversation(conversation_id))
        session = await store_call(self.sessions.get(conversation_id))
        if session is None or session.owner != owner:
            raise ApiError(404, f"conversation {conversation_id!r} not found", param="conversation",
                           code="not_found")
        # A websocket session named as a conversation is one: it gets its record when first named.
        return info or ConversationInfo(conversation_id, owner, int(session.created_at)), session


class _ResponseEvents:
    """A response's server-sent events, numbered in the order they are sent; the message item is `message_id`."""

    def __init__(self, message_id: str):
        self.message_id, self.sequence = message_id, 0

    def __call__(self, kind: str, **fields) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {_json(payload)}\n\n"

    def text_delta(self, text: str) -> str:
        return self("response.output_text.delta", item_id=self.message_id, output_index=0, content_index=0,
                    delta=text, logprobs=[])

    def message_opened(self) -> str:
        item = OutputMessage(id=self.message_id, status="in_progress", content=[]).model_dump()
        return self("response.output_item.added", output_index=0, item=item) + self(
            "response.content_part.added", item_id=self.message_id, output_index=0, content_index=0,
            part=OutputText(text="").model_dump())

    def message_done(self, message: OutputMessage) -> str:
        return self("response.output_text.done", item_id=self.message_id, output_index=0, content_index=0,
                    text=message.content[0].text, logprobs=[]) + self(
            "response.content_part.done", item_id=self.message_id, output_index=0, content_index=0,
            part=message.content[0].model_dump()) + self(
            "response.output_item.done", output_index=0, item=message.model_dump())

    def function_call(self, index: int, call: OutputFunctionCall) -> str:
        """A call as the SDK assembles it: the item, its arguments in fragments, their end, the item's end."""
        events = [self("response.output_item.added", output_index=index,
                       item=call.model_copy(update={"arguments": "", "status": "in_progress"}).model_dump())]
        for start in range(0, len(call.arguments), ARGUMENTS_FRAGMENT):
            events.append(self("response.function_call_arguments.delta", item_id=call.id, output_index=index,
                               delta=call.arguments[start:start + ARGUMENTS_FRAGMENT]))
        events.append(self("response.function_call_arguments.done", item_id=call.id, output_index=index,
                           name=call.name, arguments=call.arguments))
        events.append(self("response.output_item.done", output_index=index, item=call.model_dump()))
        return "".join(events)


def _finished(created: ResponseObject, result: TurnResult, reply: tuple[str, list[ToolCall]]) -> ResponseObject:
    """The response once its turn ended: the reply's text as a message item (unless it only made calls), its
    calls as function_call items, the usage, the status."""
    prose, calls = reply
    incomplete = None if calls else {"length": IncompleteDetails(reason="max_output_tokens"),
                                     "grammar": IncompleteDetails(reason="grammar_error")}.get(result.finish_reason)
    status = "incomplete" if incomplete else "completed"
    output: list[OutputMessage | OutputFunctionCall] = []
    if prose or not calls:
        output.append(OutputMessage(id="msg_" + created.id[5:], status=status,
                                    content=[OutputText(text=prose if calls else result.content)]))
    output += [_function_call(call) for call in calls]
    return created.model_copy(update={
        "status": status, "incomplete_details": incomplete, "output": output,
        "usage": ResponseUsage(input_tokens=result.prompt_tokens,
                               input_tokens_details=InputTokensDetails(cached_tokens=result.cached_tokens),
                               output_tokens=result.completion_tokens,
                               total_tokens=result.prompt_tokens + result.completion_tokens)})


def _function_call(call: ToolCall) -> OutputFunctionCall:
    return OutputFunctionCall(id="fc_" + call.id.removeprefix("call_"), call_id=call.id, name=call.name,
                              arguments=call.arguments)


def _listed_message(item_id: str, message: Message) -> list[InputItem | OutputFunctionCall | ListedFunctionOutput]:
    """A session's message as a conversation's items: a reply's text and each of its calls, a tool's result."""
    if message.role == "tool":
        return [ListedFunctionOutput(id=f"fco_{item_id}", call_id=message.tool_call_id or "", output=message.content)]
    kind = "output_text" if message.role == "assistant" else "input_text"
    text = [] if message.tool_calls and not message.content else \
        [InputItem(id=f"msg_{item_id}", role=message.role, content=[{"type": kind, "text": message.content}])]
    return text + [_function_call(call) for call in message.tool_calls]


def _listed_input(item_id: str, item: dict) -> InputItem | OutputFunctionCall | ListedFunctionOutput:
    """A stored input item as input_items lists it (records from before tools were served hold role and text)."""
    kind = item.get("type", "message")
    if kind == "function_call":
        return OutputFunctionCall(id=item.get("id") or f"fc_{item_id}", call_id=item["call_id"], name=item["name"],
                                  arguments=item["arguments"])
    if kind == "function_call_output":
        output = item["output"]
        return ListedFunctionOutput(id=item.get("id") or f"fco_{item_id}", call_id=item["call_id"],
                                    output=output if isinstance(output, str) else "".join(p["text"] for p in output))
    content = item["content"]
    parts = [{"type": "input_text", "text": content}] if isinstance(content, str) else content
    return InputItem(id=f"msg_{item_id}", role=item["role"], content=parts)


def _call_ids(messages: list[Message]) -> list[str]:
    return [call.id for message in messages for call in message.tool_calls]


def _item_list(items: list[InputItem]) -> ItemList:
    return ItemList(data=items, first_id=items[0].id if items else None, last_id=items[-1].id if items else None)


def _conversation(info: ConversationInfo) -> ConversationObject:
    return ConversationObject(id=info.conversation_id, created_at=info.created_at, metadata=info.metadata)


def _json(payload: dict) -> str:
    return json.dumps(payload, separators=(",", ":"))
