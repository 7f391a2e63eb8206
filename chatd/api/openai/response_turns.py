"""Where a response of the Responses API runs, whichever transport carries it (HTTP, or the WebSocket mode): the
checks of its body, the session it continues (a stored response's, one its socket made, a conversation's, or a
stateless match), its turn started, and what is kept once it ends (the stored response; a `store: false` response's
branch forgotten, or kept while its socket lives; a stateless one's session kept for the next resend).

A stored response is a point in a chatd session, so continuing from the session's latest response is a session turn
resumed from its cache (only the new input is prefilled); continuing from an earlier one branches a new session from
that point (its cache a copy of the shared part), so regenerate, edit and forks work.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Literal

from chatd.api.admission import Admission
from chatd.api.conversations import Conversations, salted
from chatd.api.http_errors import ApiError, refusals, store_call
from chatd.api.openai.input_items import CompactionItem, FunctionCallItem, InputMessage, ItemReference
from chatd.api.openai.prompt_cache import CacheAccount
from chatd.api.openai.responses_schema import (
    ConversationRef,
    IncompleteDetails,
    InputTokensDetails,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseRequest,
    ResponseUsage,
)
from chatd.api.tool_calling import RequestRefused, ToolSetup
from chatd.api.turn_errors import ErrorMessage
from chatd.api.turns import MOVED_ON, StartedTurn, TurnPlan, TurnRequest
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TurnFailed, TurnResult
from sessions import Message, Session, StoreUnavailable, ToolCall
from sessions.responses import ConversationInfo, ResponseStore, StoredResponse

ResponseEvent = str | TurnResult | TurnFailed  # the reply's text as it comes, then how it ended


@dataclass
class OpenedResponse:
    """A response whose turn has started: what its events are made of."""

    body: ResponseRequest
    created: ResponseObject
    started: StartedTurn
    setup: ToolSetup
    events: asyncio.Queue[ResponseEvent]
    cache: CacheAccount


@dataclass
class SocketResponses:
    """What one Responses WebSocket keeps of the responses it made: each lane's latest (stored or not), which
    `previous_response_id` finds before the store, and the sessions of its `store: false` chains, which live and die
    with it."""

    latest: dict[str | None, StoredResponse] = field(default_factory=dict)  # lane -> its latest response
    owned: set[str] = field(default_factory=set)  # session ids deleted when the socket closes

    def find(self, response_id: str) -> tuple[str | None, StoredResponse] | None:
        """The lane whose latest response this is, and the response."""
        return next(((lane, point) for lane, point in self.latest.items() if point.response_id == response_id), None)

    def evict(self, response_id: str) -> None:
        """A failed continuation's parent leaves the connection's cache (a stored one is still found in the store)."""
        if found := self.find(response_id):
            del self.latest[found[0]]


class ResponseTurns:
    """Opens responses: the Responses API's HTTP routes and its WebSocket mode both start every turn here."""

    def __init__(self, admission: Admission, conversations: Conversations, store: ResponseStore):
        self.admission, self.conversations, self.store = admission, conversations, store
        self.sessions, self.turns, self.engine = conversations.sessions, conversations.turns, conversations.engine

    async def open(self, owner: str | None, client: str, body: ResponseRequest, socket: SocketResponses | None = None,
                   lane: str | None = None) -> OpenedResponse:
        """Check `body` (in the order a client learns of its mistakes), find or make its session and start its turn,
        whose events then come into the returned queue; an `ApiError` when it cannot start. `socket`: the WebSocket
        connection it came on (its responses are found first, and its `store: false` sessions are its own), `lane`
        its `stream_id`."""
        body = await self.resolve_references(owner, body)
        scope = salted(owner, body.cache_salt)  # whose sessions and caches (the stored response stays the key's)
        compacted, body = await self.compacted(scope, body)
        with refusals():
            body.refuse_unsupported()
            setup = body.tool_setup(self.conversations.tool_format())
            if compacted is not None and (body.previous_response_id or body.conversation_id()):
                raise RequestRefused("input", "a compaction item starts a chain of its own: send it without "
                                              "previous_response_id or conversation")
            if not body.previous_response_id and not body.conversation_id() and compacted is None:
                body.check_outputs()  # otherwise against the history, once it is read
        self.admission.check_model(body.model)
        max_new_tokens = self.admission.max_new_tokens(body.max_output_tokens)
        self.admission.refuse_when_unavailable()
        grammar = None if body.warm_up else await self.admission.compile(setup, "text.format")
        params = SamplingParams(max_new_tokens=1 if body.warm_up else max_new_tokens, temperature=body.temperature,
                                top_p=body.top_p, grammar=grammar)
        created = _created(body)
        try:
            comparison = await self._comparison(owner, body, socket)
            session, started = await self._start(owner, scope, body, params, created.id, client, setup, socket,
                                                 compacted)
        except StoreUnavailable as error:
            raise ApiError(503, f"{error}; try again shortly", code="unavailable") from None
        if isinstance(started, ErrorMessage):
            if _disposable(body, socket):
                await self._forget(session.session_id)
            raise ApiError.of(started)
        cache = CacheAccount(body.explicit_cache, self._breakpoint_ids(body, started.session, setup)
                             if body.explicit_cache else None, comparison is not False, comparison or None)
        events: asyncio.Queue[ResponseEvent] = asyncio.Queue()
        self.turns.forward(started, events.put, lambda event: self._ended(
            owner, scope, body, created, started, cache, event, events, socket, lane))
        return OpenedResponse(body, created, started, setup, events, cache)

    async def _comparison(self, owner: str | None, body: ResponseRequest, socket: SocketResponses | None
                          ) -> dict | None | Literal[False]:
        """The object of the response named by `prompt_cache_options.comparison_response_id`, from the socket's or
        the key's stored responses (None: not found; False: none named)."""
        response_id = body.prompt_cache_options.comparison_response_id if body.prompt_cache_options else None
        if response_id is None:
            return False
        found = socket.find(response_id) if socket is not None else None
        stored = found[1] if found else await self.store.get(response_id)
        return stored.body if stored is not None and stored.owner == owner else None

    def _breakpoint_ids(self, body: ResponseRequest, session: Session, setup: ToolSetup) -> list[int]:
        """The prompt's ids up to the end of the message holding the request's last `prompt_cache_breakpoint` ([]:
        none). The turn's messages are the session's history then its new ones; the request's messages (after a
        leading system message, the session's system prompt) are their tail."""
        marks = body.breakpoints()
        if not marks:
            return []
        index = max(index for index, _ in marks)
        messages = body.messages()
        if messages[0].role == "system":
            if index == 0:
                return self.conversations.render(session.system, [], [], setup, add_generation_prompt=False)
            messages, index = messages[1:], index - 1
        turn = session.messages + body.split()[1]
        at = len(turn) - len(messages) + index
        return self.conversations.render(session.system, turn[:at], turn[at:at + 1], setup,
                                         add_generation_prompt=False) if at >= 0 else []

    async def resolve_references(self, owner: str | None, body: ResponseRequest) -> ResponseRequest:
        """`body` with each `item_reference` replaced by the output item it names, from this key's stored responses
        (a 400 naming `input[i].id` when there is none)."""
        if isinstance(body.input, str) or not any(isinstance(item, ItemReference) for item in body.input):
            return body
        items = []
        for index, item in enumerate(body.input):
            if isinstance(item, ItemReference):
                stored = await store_call(self.store.find_item(item.id))
                output = stored.body.get("output", []) if stored is not None and stored.owner == owner else []
                found = next((sent for sent in output if sent.get("id") == item.id), None)
                if found is None:
                    raise ApiError(400, f"input[{index}] refers to item {item.id!r}, which no stored response of this "
                                        "key holds", param=f"input[{index}].id", code="not_found")
                item = (FunctionCallItem if found.get("type") == "function_call" else InputMessage).model_validate(
                    found)
            items.append(item)
        return body.model_copy(update={"input": items})

    async def compacted(self, scope: str | None, body: ResponseRequest
                        ) -> tuple[tuple[Session, int, int] | None, ResponseRequest]:
        """The window of the last compaction item in `input` (its session, and the version and messages it had when
        made; a 400 naming the item when this scope holds none such), and the request with only the input after it
        (what came before is the window's own)."""
        items = [] if isinstance(body.input, str) else body.input
        index = next((index for index in range(len(items) - 1, -1, -1) if isinstance(items[index], CompactionItem)),
                     None)
        if index is None:
            return None, body
        point = items[index].point()
        session = await store_call(self.sessions.get(point[0])) if point is not None else None
        if session is None or session.owner != scope or session.version < point[1] or \
                len(session.messages) < point[2]:
            raise ApiError(400, f"input[{index}] is a compaction this server does not hold (it expired, or another key "
                                "or cache_salt made it): compact the conversation again",
                           param=f"input[{index}].encrypted_content", code="invalid_encrypted_content")
        return (session, point[1], point[2]), body.model_copy(update={"input": items[index + 1:]})

    async def _start(self, owner: str | None, scope: str | None, body: ResponseRequest, params: SamplingParams,
                     response_id: str, client: str, setup: ToolSetup, socket: SocketResponses | None,
                     compacted: tuple[Session, int, int] | None) -> tuple[Session, StartedTurn | ErrorMessage]:
        """The session the response runs in and its turn started (or why not). `owner`: the key's id; `scope`: whose
        sessions and caches (the key's, or its `cache_salt`'s); `compacted`: the window a compaction item named."""
        extra, new = body.split()
        plan = TurnPlan(new, params, setup, keep_for_s=body.keep_for_s(), generate=not body.warm_up,
                        truncate=body.truncation == "auto")

        def request(session: Session, expected_version: int | None = None) -> TurnRequest:
            return TurnRequest(session.session_id, response_id, scope, client, "responses", plan, expected_version)

        if conversation_id := body.conversation_id():
            if extra or not body.store:
                raise ApiError(400, "a response in a conversation takes only new input (a user message or function "
                                    "call outputs) and is stored", param="input" if extra else "store",
                               code="bad_request")
            _, session = await self.owned_conversation(owner, conversation_id)
            with refusals():
                body.check_outputs(call_ids(session.messages))
            started = await self.turns.start(request(session))
            if isinstance(started, ErrorMessage) and started.code == "busy":
                raise ApiError(409, f"a response of conversation {conversation_id!r} is running; wait for it",
                               param="conversation", code="conflict")
            return session, started
        system = body.instructions
        if body.previous_response_id:
            session, fresh = await self._from_previous(owner, scope, body, extra, new, setup, socket)
        elif compacted is not None:
            session, fresh = await self._continue_at(scope, body, *compacted, extra, new, setup)
        else:
            if extra and extra[0].role == "system":
                system, extra = (extra[0].content if system is None else system), extra[1:]
            session, _, matched = await self.conversations.place(scope, system, extra, new, None, setup,
                                                                 body.prompt_cache_key)
            fresh = not matched
        if not body.store and not fresh and (_disposable(body, socket) or
                                             socket is not None and session.session_id not in socket.owned):
            # Nothing may be left behind: the turn runs in a session of its own, deleted after the reply (or, on a
            # socket, when it closes).
            session = await self.conversations.branch_from(scope, session.system, session.messages, new, session, setup)
            fresh = True
        if not body.store and socket is not None:
            socket.owned.add(session.session_id)
        started = await self.turns.start(request(session, None if fresh else session.version))
        if isinstance(started, ErrorMessage) and started.code in MOVED_ON and not fresh:
            # Another turn holds that session, or another worker ran one of it meanwhile: this response branches
            # from its point.
            if body.previous_response_id:
                session, _ = await self._from_previous(owner, scope, body, extra, new, setup, socket, branch=True)
            elif compacted is not None:
                session, _ = await self._continue_at(scope, body, *compacted, extra, new, setup, branch=True)
            else:
                session = await self.conversations.branch_from(scope, system, extra, new, session, setup)
            if not body.store and socket is not None:
                socket.owned.add(session.session_id)
            started = await self.turns.start(request(session))
        return session, started

    async def _from_previous(self, owner: str | None, scope: str | None, body: ResponseRequest, extra: list[Message],
                             new: list[Message], setup: ToolSetup, socket: SocketResponses | None,
                             branch: bool = False) -> tuple[Session, bool]:
        """The session that continues `previous_response_id`, and whether it is new: its own when that response is
        its latest point, no turn holds it and nothing is added before the new input (unless `branch`);
        otherwise a branch from that point. A previous response of another `cache_salt` is not found; the
        responses a socket made are found there first (its `store: false` ones only there)."""
        found = socket.find(body.previous_response_id) if socket is not None else None
        previous = found[1] if found else await store_call(self.store.get(body.previous_response_id))
        if previous is None or previous.owner != owner:
            raise ApiError(400 if socket is not None else 404, f"previous response {body.previous_response_id!r} "
                           "not found", param="previous_response_id", code="previous_response_not_found")
        session = await store_call(self.sessions.get(previous.session_id))
        if session is None or session.owner != scope:
            raise ApiError(400 if socket is not None else 404, f"previous response {body.previous_response_id!r} not "
                           "found (its conversation expired, or it was made with another cache_salt)",
                           param="previous_response_id", code="previous_response_not_found")
        return await self._continue_at(scope, body, session, previous.version, previous.messages, extra, new, setup,
                                       branch)

    async def _continue_at(self, scope: str | None, body: ResponseRequest, session: Session, version: int,
                           messages: int, extra: list[Message], new: list[Message], setup: ToolSetup,
                           branch: bool = False) -> tuple[Session, bool]:
        """The session that continues `session` at the point where it held `messages` messages at `version`, and
        whether it is new: `session` itself when that is its latest point, no turn holds it and nothing is added
        before the new input (unless `branch`); otherwise a branch from that point."""
        with refusals():
            body.check_outputs(call_ids(session.messages[:messages]))
        system = body.instructions if body.instructions is not None else session.system
        if not branch and session.version == version and not extra and system == session.system and \
                not self.turns.is_claimed(session.session_id):
            return session, False
        history = session.messages[:messages] + extra
        ids = self.conversations.render(system, history, new, setup)
        return await self.conversations.branch(scope, system, history, ids, [(session, history, ids)]), True

    async def _ended(self, owner: str | None, scope: str | None, body: ResponseRequest, created: ResponseObject,
                     started: StartedTurn, cache: CacheAccount, event: TurnResult | TurnFailed, events: asyncio.Queue,
                     socket: SocketResponses | None, lane: str | None) -> None:
        """The turn is recorded (or failed): store the response and index the conversation (or, for
        `store: false`, forget its session unless a socket keeps it), then hand over the end."""
        session = started.session
        if isinstance(event, TurnResult) and event.finish_reason != "cancelled":
            stored = StoredResponse(created.id, owner, session.session_id, session.version,  # (the turn is recorded)
                                    len(session.messages),
                                    finished(created, event, started.reply, cache).model_dump(), body.input_record())
            if body.store:
                try:
                    await self.store.put(stored)
                    conversation_id = body.conversation_id()
                    if conversation_id and (info := await self.store.get_conversation(conversation_id)) is not None:
                        await self.store.put_conversation(info)  # its retention renewed with its session's
                except StoreUnavailable:
                    event = TurnFailed("unavailable", "the reply could not be stored; send the input again")
            if isinstance(event, TurnResult):
                if body.store or socket is None and not _disposable(body, socket):
                    await self.conversations.ended(scope, session.session_id, event, body.prompt_cache_key)
                if socket is not None:
                    socket.latest[lane] = stored
                    if body.store:
                        socket.owned.discard(session.session_id)  # (a stored response's session outlives the socket)
        if _disposable(body, socket):
            await self._forget(session.session_id)
        await events.put(event)

    async def _forget(self, session_id: str) -> None:
        """A `store: false` response's session: gone once the reply is sent (or its socket closed)."""
        try:
            await self.sessions.delete(session_id)
        except StoreUnavailable:
            pass  # it expires with the retention
        self.engine.close_session(session_id)

    async def close_socket(self, socket: SocketResponses) -> None:
        """A Responses WebSocket closed: the sessions of its `store: false` chains go with it."""
        for session_id in socket.owned:
            if not self.turns.is_claimed(session_id):
                await self._forget(session_id)

    async def owned_conversation(self, owner: str | None, conversation_id: str
                                 ) -> tuple[ConversationInfo, Session]:
        """The conversation's record and session, if it is this key's; else a 404."""
        info = await store_call(self.store.get_conversation(conversation_id))
        session = await store_call(self.sessions.get(conversation_id))
        if session is None or session.owner != owner:
            raise ApiError(404, f"conversation {conversation_id!r} not found", param="conversation",
                           code="not_found")
        # A websocket session named as a conversation is one: it gets its record when first named.
        return info or ConversationInfo(conversation_id, owner, int(session.created_at)), session


def _disposable(body: ResponseRequest, socket: SocketResponses | None) -> bool:
    """Whether the response's session goes once its reply is sent: a `store: false` response that continues a
    previous one over HTTP (its branch is its alone). A stateless `store: false` response keeps its session, matched
    and indexed as a chat completion's, so that a client resending its history reads it from the cache (OpenAI's
    prompt cache does not depend on `store`; the response itself is never stored); a socket's `store: false`
    sessions go when it closes."""
    return not body.store and socket is None and body.previous_response_id is not None


def _created(body: ResponseRequest) -> ResponseObject:
    """The response as `response.created` announces it."""
    return ResponseObject(id="resp_" + secrets.token_hex(16), created_at=int(time.time()), status="in_progress",
                          model=body.model, instructions=body.instructions,
                          previous_response_id=body.previous_response_id,
                          conversation=ConversationRef(id=cid) if (cid := body.conversation_id()) else None,
                          metadata=body.metadata or {}, user=body.user, store=body.store,
                          temperature=body.temperature, top_p=body.top_p, max_output_tokens=body.max_output_tokens,
                          tools=[{**tool, "strict": tool.get("strict") is not False} for tool in body.tools or []],
                          tool_choice=body.tool_choice or "auto",
                          parallel_tool_calls=body.parallel_tool_calls is not False,
                          text=body.text or {"format": {"type": "text"}}, safety_identifier=body.safety_identifier,
                          prompt_cache_key=body.prompt_cache_key, truncation=body.truncation,
                          prompt_cache_retention=body.prompt_cache_retention,
                          prompt_cache_options={"mode": options.mode, "ttl": options.ttl or "30m",
                                                "comparison_response_id": options.comparison_response_id}
                          if (options := body.prompt_cache_options) is not None else None)


def finished(created: ResponseObject, result: TurnResult, reply: tuple[str, list[ToolCall]],
             cache: CacheAccount) -> ResponseObject:
    """The response once its turn ended: the reply's text as a message item (unless it only made calls), its
    calls as function_call items, the usage (what it wrote as `cache` counts it), the status, the cache
    diagnostics if asked. A warm-up has no output; a steered reply is incomplete."""
    prose, calls = reply
    incomplete = {"steered": IncompleteDetails(reason="steered")}.get(result.finish_reason) or (None if calls else {
        "length": IncompleteDetails(reason="max_output_tokens"),
        "grammar": IncompleteDetails(reason="grammar_error")}.get(result.finish_reason))
    status = "incomplete" if incomplete else "completed"
    output: list[OutputMessage | OutputFunctionCall] = []
    if result.finish_reason != "prefilled" and (prose or not calls):
        output.append(OutputMessage(id="msg_" + created.id[5:], status=status,
                                    content=[OutputText(text=prose)]))
    output += [function_call(call) for call in calls]
    return created.model_copy(update={
        "status": status, "incomplete_details": incomplete, "output": output,
        "completed_at": int(time.time()) if status == "completed" else None,
        "usage": ResponseUsage(input_tokens=result.prompt_tokens,
                               input_tokens_details=InputTokensDetails(
                                   cached_tokens=result.cached_tokens,
                                   cache_write_tokens=cache.write_tokens(result)),
                               output_tokens=result.completion_tokens,
                               total_tokens=result.prompt_tokens + result.completion_tokens),
        "prompt_cache_diagnostics": cache.diagnostics(result, created.model_dump())})


def function_call(call: ToolCall) -> OutputFunctionCall:
    """A call of a reply as an output item."""
    return OutputFunctionCall(id="fc_" + call.id.removeprefix("call_"), call_id=call.id, name=call.name,
                              arguments=call.arguments)


def call_ids(messages: list[Message]) -> list[str]:
    """The ids of the calls `messages` made, which a function_call_output may answer."""
    return [call.id for message in messages for call in message.tool_calls]
