"""OpenAI's Responses API (`/v1/responses`) and Conversations API (`/v1/conversations`) over chatd sessions: the HTTP
routes. A response runs through `ResponseTurns` (as over the WebSocket mode) and streams `response_events`.

The Responses API is stateful: a response is stored, and the next request sends only its new input (a user
message, or the outputs of the functions the response called) with `previous_response_id`, or names a
`conversation`. A conversation is a session. Without either, a request is matched like a chat completion (the
prefix index): the Agents SDK resends a run's items, and its next round continues the session the last one left.
Turns run through the same `TurnRunner`, tools, grammars, keys, limits, leases and metrics as the other APIs.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Query, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatd.api.constants import SESSION_HEADER, WORKER, WORKER_HEADER
from chatd.api.http_errors import ApiError, refusals, store_call
from chatd.api.openai.compaction import Compactions, CompactRequest
from chatd.api.openai.conversation_items import item_list, items_of, without_item
from chatd.api.openai.response_events import response_events
from chatd.api.openai.response_turns import ResponseTurns, call_ids, finished
from chatd.api.openai.responses_schema import (
    ConversationCreate,
    ConversationDeleted,
    ConversationItemsAdd,
    ConversationObject,
    InputItem,
    ListedFunctionOutput,
    OutputFunctionCall,
    ResponseDeleted,
    ResponseRequest,
)
from chatd.api.tool_calling import RequestRefused, ToolSetup
from chatd.api.turn_errors import ErrorMessage
from chatd.api.turns import TurnPlan, TurnRequest
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TurnFailed
from sessions import Session, SessionBusy, VersionConflict
from sessions.responses import ConversationInfo, StoredResponse


class ResponsesApi:
    """The Responses and Conversations routes, sharing the OpenAI API's authentication, matching and turns."""

    def __init__(self, response_turns: ResponseTurns):
        self.response_turns, self.admission, self.store = response_turns, response_turns.admission, response_turns.store
        self.conversations, self.sessions = response_turns.conversations, response_turns.sessions
        self.turns, self.engine = response_turns.turns, response_turns.engine
        errors = {code: {"model": dict} for code in (400, 401, 404, 409, 429, 503)}
        self.router = APIRouter(prefix="/v1")
        self.compactions = Compactions(response_turns)
        self.router.add_api_route("/responses", self.create, methods=["POST"], responses=errors)
        self.router.add_api_route("/responses/compact", self.compact, methods=["POST"], responses=errors)
        self.router.add_api_route("/responses/{response_id}", self.retrieve, methods=["GET"])
        self.router.add_api_route("/responses/{response_id}", self.delete, methods=["DELETE"])
        self.router.add_api_route("/responses/{response_id}/input_items", self.input_items, methods=["GET"])
        self.router.add_api_route("/conversations", self.create_conversation, methods=["POST"])
        self.router.add_api_route("/conversations/{conversation_id}", self.retrieve_conversation, methods=["GET"])
        self.router.add_api_route("/conversations/{conversation_id}", self.delete_conversation, methods=["DELETE"])
        self.router.add_api_route("/conversations/{conversation_id}/items", self.conversation_items, methods=["GET"])
        self.router.add_api_route("/conversations/{conversation_id}/items", self.add_conversation_items,
                                  methods=["POST"])
        self.router.add_api_route("/conversations/{conversation_id}/items/{item_id}", self.conversation_item,
                                  methods=["GET"])
        self.router.add_api_route("/conversations/{conversation_id}/items/{item_id}", self.delete_conversation_item,
                                  methods=["DELETE"])

    # ##### Responses #####

    async def create(self, request: Request, body: ResponseRequest) -> Response:
        owner = self.admission.authenticate(request)
        client = owner or (request.client.host if request.client else "unknown")
        opened = await self.response_turns.open(owner, client, body)
        event = await opened.events.get()  # a turn that fails before its first token gets its own status code
        if isinstance(event, TurnFailed):
            raise ApiError.of(event)
        headers = {SESSION_HEADER: opened.started.session.session_id, WORKER_HEADER: WORKER}
        if body.stream:
            return StreamingResponse(_sse(response_events(opened, event)), media_type="text/event-stream",
                                     headers={**headers, "Cache-Control": "no-cache"})
        while isinstance(event, str):
            event = await opened.events.get()
        if isinstance(event, TurnFailed):
            raise ApiError.of(event)
        done = finished(opened.created, event, opened.started.reply, opened.cache)
        return JSONResponse(done.model_dump(), headers=headers)

    async def compact(self, request: Request, body: CompactRequest) -> Response:
        """The conversation cut to its newest turns, in a window that starts a new chain (`compaction`)."""
        owner = self.admission.authenticate(request)
        compacted = await self.compactions.compact(owner, owner or (request.client.host if request.client else
                                                                    "unknown"), body)
        return JSONResponse(compacted.model_dump())

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
        return JSONResponse(item_list(items).model_dump())

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

    async def conversation_items(self, request: Request, conversation_id: str, order: Literal["asc", "desc"] = "desc",
                                 limit: int = Query(20, ge=1, le=100), after: str | None = None) -> Response:
        """A page of the conversation's items, newest first unless `order=asc` (OpenAI's default and cursor)."""
        _, session = await self._conversation(request, conversation_id)
        items = items_of(conversation_id, session)
        if order == "desc":
            items.reverse()
        if after is not None:
            items = items[next((index + 1 for index, item in enumerate(items) if item.id == after), len(items)):]
        page = item_list(items[:limit])
        page.has_more = len(items) > limit
        return JSONResponse(page.model_dump())

    async def conversation_item(self, request: Request, conversation_id: str, item_id: str) -> Response:
        _, session = await self._conversation(request, conversation_id)
        found = next((item for item in items_of(conversation_id, session) if item.id == item_id), None)
        if found is None:
            raise ApiError(404, f"item {item_id!r} not found in conversation {conversation_id!r}", param="item_id",
                           code="not_found")
        return JSONResponse(found.model_dump())

    async def add_conversation_items(self, request: Request, conversation_id: str, body: ConversationItemsAdd
                                     ) -> Response:
        """Items appended to the conversation (openai-agents' `OpenAIConversationsSession` keeps its history so):
        a warm-up turn of its session, so that they are recorded and prefilled into its cache as a turn's input is;
        answered with the items as listed."""
        owner = self.admission.authenticate(request)
        self.admission.refuse_when_unavailable()
        _, session = await self._conversation(request, conversation_id)
        warm_up = await self.response_turns.resolve_references(owner, ResponseRequest(
            model=self.admission.settings.model, input=body.items, generate=False))
        try:
            warm_up.check_outputs(call_ids(session.messages))
        except RequestRefused as error:  # (named as this body names them)
            raise ApiError(400, str(error).replace("input[", "items["), param=error.param.replace("input", "items", 1),
                           code="bad_request") from None
        messages = warm_up.messages()
        if messages and messages[0].role == "system":
            raise ApiError(400, "a system or developer item may only start a conversation", param="items[0]",
                           code="bad_request")
        before = len(session.messages)
        started = await self.turns.start(TurnRequest(
            session.session_id, "conv_items_" + secrets.token_hex(8), owner,
            owner or (request.client.host if request.client else "unknown"), "responses",
            TurnPlan(messages, SamplingParams(max_new_tokens=1), ToolSetup(self.conversations.tool_format()),
                     generate=False)))
        if isinstance(started, ErrorMessage):
            raise ApiError(409, f"a response of conversation {conversation_id!r} is running; wait for it",
                           param="conversation_id", code="conflict") if started.code == "busy" else \
                ApiError.of(started)
        await self.conversations.result(*await self.conversations.relay(owner, started))
        items = items_of(conversation_id, started.session, before)
        return JSONResponse(item_list(items).model_dump())

    async def delete_conversation_item(self, request: Request, conversation_id: str, item_id: str) -> Response:
        """One item left out of the conversation (answered with the conversation, as OpenAI's). The session's cache
        stays of use up to where the history changed: its next response prefills from there."""
        info, session = await self._conversation(request, conversation_id)
        busy = ApiError(409, f"a response of conversation {conversation_id!r} is running; wait for it",
                        param="conversation_id", code="conflict")
        if self.turns.is_claimed(session.session_id):
            raise busy
        with refusals():
            edited = without_item(conversation_id, session, item_id)
        if edited is None:
            raise ApiError(404, f"item {item_id!r} not found in conversation {conversation_id!r}", param="item_id",
                           code="not_found")
        version = session.version
        try:
            await store_call(self.sessions.rewrite(session, edited.system, edited.messages, edited.removed_items,
                                                   edited.dropped_turns))
        except (VersionConflict, SessionBusy):
            raise busy from None
        self.engine.carry_cache_forward(session.session_id, version, session.version)
        return JSONResponse(_conversation(info).model_dump())

    # ##### Lookups #####

    async def _stored(self, request: Request, response_id: str) -> StoredResponse:
        owner = self.admission.authenticate(request)
        stored = await store_call(self.store.get(response_id))
        if stored is None or stored.owner != owner:
            raise ApiError(404, f"response {response_id!r} not found", param="response_id", code="not_found")
        return stored

    async def _conversation(self, request: Request, conversation_id: str) -> tuple[ConversationInfo, Session]:
        return await self.response_turns.owned_conversation(self.admission.authenticate(request), conversation_id)


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


def _conversation(info: ConversationInfo) -> ConversationObject:
    return ConversationObject(id=info.conversation_id, created_at=info.created_at, metadata=info.metadata)


async def _sse(events: AsyncIterator[dict]) -> AsyncIterator[str]:
    """The events as server-sent events."""
    async for event in events:
        yield f"event: {event['type']}\ndata: {json.dumps(event, separators=(',', ':'))}\n\n"
