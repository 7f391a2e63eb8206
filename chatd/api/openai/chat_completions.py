"""The OpenAI-compatible API: `GET /v1/models` and `POST /v1/chat/completions`, streamed (SSE) or not.

OpenAI clients are stateless: each request carries the whole conversation and no session id. The
request is rendered to token ids and matched, through the prefix index (in Redis when sessions are, so
any worker finds any conversation), against the conversations of the same key; the session whose cached
ids it shares the most with is continued when the request extends it exactly, and otherwise branched (a
new session whose cache starts as a copy of the shared part). Either way only the tokens after the reused
prefix are prefilled. The turn itself runs through the `TurnRunner` exactly as a websocket turn does
(claims, rate limit, leases, metrics, recording).
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from fastapi.exceptions import RequestValidationError
from starlette.responses import JSONResponse, Response, StreamingResponse

from cache_store.lookup import common_prefix_length
from chatd.api.auth import KeyRing
from chatd.api.gateway import WORKER
from chatd.api.openai.chat_schema import (
    AssistantMessage,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    Choice,
    ChunkChoice,
    ChunkDelta,
    CompletionTokensDetails,
    CompletionUsage,
    ErrorBody,
    ErrorResponse,
    FunctionCallDelta,
    FunctionCallOut,
    ModelCard,
    ModelList,
    RequestRefused,
    ToolCallDelta,
    ToolCallOut,
)
from chatd.api.openai.tools import ToolFormat, ToolSetup, compile_grammar, format_for
from chatd.api.protocol import ErrorMessage
from chatd.api.turns import StartedTurn, TurnRunner
from chatd.config import Settings
from chatd.engine.grammar import CompiledGrammar
from chatd.engine.sampling import SamplingParams
from chatd.engine.scheduler import Engine
from chatd.engine.turn import TurnFailed, TurnResult
from chatd.model.prompt import PromptRenderer
from sessions import Message, Session, SessionStore, StoreUnavailable, ToolCall
from sessions.prefix_index import BLOCK
from sessions.redis_store import RedisSessionStore
from sessions.shared_prefix_index import SharedPrefixIndex

log = logging.getLogger(__name__)
SESSION_HEADER = "X-Chatd-Session-Id"  # a client or gateway pins later requests with it (as X-Session-Id)
WORKER_HEADER = "X-Chatd-Worker"  # host:pid of the worker that answered
DEFAULT_MAX_TOKENS = 256
ARGUMENTS_FRAGMENT = 32  # characters of a call's arguments per streamed chunk

# chatd's error codes (websocket protocol and engine) as HTTP statuses and OpenAI error types.
_STATUS = {"bad_request": 400, "limit_exceeded": 400, "too_long": 400, "unauthorized": 401, "unknown_session": 404,
           "rate_limited": 429, "conflict": 409, "busy": 503, "unavailable": 503, "internal": 500}
_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "conflict_error",
         429: "rate_limit_error", 500: "server_error", 503: "service_unavailable"}


class ApiError(Exception):
    """A failed OpenAI API request: its status, and the error body OpenAI's clients parse."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s

    @classmethod
    def of(cls, error: ErrorMessage | TurnFailed) -> ApiError:
        return cls(_STATUS.get(error.code, 500), error.message, code=error.code,
                   retry_after_s=getattr(error, "retry_after_s", None))

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorBody(message=self.message, type=_TYPE.get(self.status, "server_error"),
                                             param=self.param, code=self.code))

    def response(self) -> Response:
        headers = {"Retry-After": str(math.ceil(self.retry_after_s))} if self.retry_after_s is not None else None
        return JSONResponse(self.body().model_dump(), self.status, headers)


class OpenAIApi:
    """The OpenAI-compatible routes over the turn runner, and the index that finds a resent conversation's
    session."""

    def __init__(self, engine: Engine, sessions: SessionStore, settings: Settings, turns: TurnRunner, keys: KeyRing):
        self.engine, self.sessions, self.settings, self.turns, self.keys = engine, sessions, settings, turns, keys
        # In Redis when sessions are: every worker finds every conversation, whichever worker it reached before.
        shared = isinstance(sessions, RedisSessionStore)
        self.index = SharedPrefixIndex(sessions.client if shared else None, settings.session_retention_s,
                                       sessions.events if shared else None)
        self.created = int(time.time())
        self._renderer: PromptRenderer | None = None
        self.router = APIRouter(prefix="/v1")
        self.router.add_api_route("/models", self.models, methods=["GET"], response_model=ModelList)
        self.router.add_api_route("/chat/completions", self.chat_completions, methods=["POST"],
                                  response_model=ChatCompletion,
                                  responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)})

    def install_error_handlers(self, app) -> None:
        """OpenAI's error shape for every failure of these routes, a malformed body included."""
        app.add_exception_handler(ApiError, lambda request, error: error.response())

        async def invalid_body(request: Request, error: RequestValidationError) -> Response:
            first = error.errors()[0] if error.errors() else {}
            where = ".".join(str(part) for part in first.get("loc", ())[1:]) or None
            return ApiError(400, f"invalid request: {first.get('msg', 'malformed body')}"
                                 f"{f' (at {where})' if where else ''}", param=where, code="bad_request").response()

        app.add_exception_handler(RequestValidationError, invalid_body)

    async def models(self, request: Request) -> ModelList:
        self.authenticate(request)
        return ModelList(data=[ModelCard(id=self.settings.model, created=self.created)])

    async def chat_completions(self, request: Request, body: ChatCompletionRequest,
                               x_session_id: Annotated[str | None, Header()] = None) -> Response:
        owner = self.authenticate(request)
        try:
            body.refuse_unsupported()
        except RequestRefused as error:
            raise ApiError(400, str(error), param=error.param, code="bad_request") from None
        if body.model not in self.model_names():
            raise ApiError(404, f"the model {body.model!r} does not exist; this server serves "
                                f"{self.settings.model!r}", param="model", code="model_not_found")
        max_new_tokens = body.max_completion_tokens or body.max_tokens or min(DEFAULT_MAX_TOKENS,
                                                                             self.settings.max_new_tokens)
        if max_new_tokens > self.settings.max_new_tokens:
            raise ApiError(400, f"max_tokens {max_new_tokens} is over this server's cap of "
                                f"{self.settings.max_new_tokens}", param="max_tokens", code="limit_exceeded")
        self.refuse_when_unavailable()
        try:
            setup = body.tool_setup(self.tool_format())
        except RequestRefused as error:
            raise ApiError(400, str(error), param=error.param, code="bad_request") from None
        system, history, content = body.conversation()
        client = owner or (request.client.host if request.client else "unknown")
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=body.stop_list(),
                                grammar=await self.compile(setup))
        turn_id = "chatcmpl-" + secrets.token_urlsafe(12)
        try:
            session, plain_ids, matched = await self.place(owner, system, history, content,
                                                            body.session_id or body.prompt_cache_key or x_session_id,
                                                            setup)
            started = await self.begin(session, content, params, turn_id, owner, client,
                                        expected_version=session.version if matched else None, setup=setup)
            if isinstance(started, ErrorMessage) and started.code in ("busy", "conflict") and matched:
                # Another worker runs or ran a turn of the matched session meanwhile (an identical conversation
                # elsewhere): this request branches into a session of its own, with exactly its history.
                session = await self.branch_from(owner, system, history, content, session, setup)
                started = await self.begin(session, content, params, turn_id, owner, client, setup=setup)
        except StoreUnavailable as error:
            raise ApiError(503, f"{error}; try again shortly", code="unavailable") from None
        if isinstance(started, ErrorMessage):
            raise ApiError.of(started)
        events: asyncio.Queue[str | TurnResult | TurnFailed] = asyncio.Queue()
        self.turns.forward(started, events.put, lambda event: self._ended(owner, started, event, events))
        first = await events.get()
        if isinstance(first, TurnFailed):
            raise ApiError.of(first)
        headers = {SESSION_HEADER: session.session_id, WORKER_HEADER: WORKER}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream(started, first, events, body.model, include_usage, setup),
                                     media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        result = first
        while isinstance(result, str):  # the text comes whole with the result
            result = await events.get()
        if isinstance(result, TurnFailed):
            raise ApiError.of(result)
        text, calls = started.reply
        message = AssistantMessage(content=text or None if calls else text,
                                   tool_calls=[_call_out(call) for call in calls] or None)
        completion = ChatCompletion(id=turn_id, created=int(time.time()), model=body.model, choices=[Choice(
            message=message, finish_reason=_finish(result, calls))], usage=_usage(result))
        return JSONResponse(completion.model_dump(), headers=headers)

    def tool_format(self) -> ToolFormat:
        """How the served model's template renders tools and how it writes calls."""
        return format_for(self.engine.loaded.tokenizer.chat_template)

    async def compile(self, setup: ToolSetup, format_param: str = "response_format") -> CompiledGrammar | None:
        """The reply's grammar; a 400 naming the tools or the response format when it cannot compile."""
        try:
            return await compile_grammar(self.engine.grammars, setup, format_param)
        except RequestRefused as error:
            raise ApiError(400, str(error), param=error.param, code="bad_request") from None

    async def _ended(self, owner: str | None, started: StartedTurn, event: TurnResult | TurnFailed,
                     events: asyncio.Queue) -> None:
        """The turn is recorded (or failed): index the conversation it reached, then hand over the end."""
        if isinstance(event, TurnResult) and event.finish_reason != "cancelled":
            await self.index.add(owner, started.session.session_id, event.conversation_ids)
        await events.put(event)

    async def _stream(self, started: StartedTurn, first: str | TurnResult, events: asyncio.Queue, model: str,
                      include_usage: bool, setup: ToolSetup) -> AsyncIterator[str]:
        """Server-sent events: the role, the text, the calls (each: its id and name, then fragments of its
        arguments), the finish reason, the usage if asked, [DONE]. Text from where the model opens a call on
        is held back and sent as calls once the reply is read. A client that goes away cancels the turn."""
        turn_id, created = started.turn.turn_id, int(time.time())

        def chunk(delta: ChunkDelta, finish: str | None = None, usage: CompletionUsage | None = None,
                  choices: bool = True) -> str:
            body = ChatCompletionChunk(id=turn_id, created=created, model=model, usage=usage, choices=[
                ChunkChoice(delta=delta, finish_reason=finish)] if choices else []).model_dump()
            for choice in body["choices"]:  # as OpenAI's wire: a delta names only what it carries of a call
                if (calls := choice["delta"].pop("tool_calls")) is not None:
                    choice["delta"]["tool_calls"] = [_without_none(call) for call in calls]
            return f"data: {json.dumps(body, ensure_ascii=False)}\n\n"

        event = first
        prose = setup.prose_stream()
        try:
            yield chunk(ChunkDelta(role="assistant", content=""))
            while isinstance(event, str):
                if text := prose.push(event):
                    yield chunk(ChunkDelta(content=text))
                event = await events.get()
            if isinstance(event, TurnFailed):
                yield f"data: {ApiError.of(event).body().model_dump_json()}\n\n"
                return
            text, calls = started.reply
            if rest := prose.rest(text, bool(calls)):
                yield chunk(ChunkDelta(content=rest))
            for index, call in enumerate(calls):
                yield chunk(ChunkDelta(tool_calls=[ToolCallDelta(index=index, id=call.id, type="function",
                                                                 function=FunctionCallDelta(name=call.name,
                                                                                            arguments=""))]))
                for start in range(0, len(call.arguments), ARGUMENTS_FRAGMENT):
                    fragment = call.arguments[start:start + ARGUMENTS_FRAGMENT]
                    yield chunk(ChunkDelta(tool_calls=[ToolCallDelta(index=index, function=FunctionCallDelta(
                        arguments=fragment))]))
            yield chunk(ChunkDelta(), _finish(event, calls))
            if include_usage:
                yield chunk(ChunkDelta(), usage=_usage(event), choices=False)
            yield "data: [DONE]\n\n"
        finally:
            if isinstance(event, str):  # the client left mid-stream
                started.turn.cancel()

    async def place(self, owner: str | None, system: str | None, history: list[Message], content: str | list[Message],
                    hint: str | None, setup: ToolSetup | None = None) -> tuple[Session, list[int], bool]:
        """The session this request runs in, claimed for it, the request's plain prompt ids, and whether the
        session is one it continues: the matched session when the request extends it exactly and it is free;
        otherwise a new one, branched from the best match's cache. The history's replies get the ids the
        model generated for them wherever a session knows them."""
        plain_ids = self.render(system, history, content, setup)
        matches = []
        for session in await self._candidates(owner, plain_ids, hint):
            if session.system == system and _same(session.messages, history) and \
                    self.turns.try_claim(session.session_id):
                return session, plain_ids, True
            spliced = _splice(history, session.messages)
            prompt_ids = plain_ids if spliced == history and _ids_of(spliced) == _ids_of(history) else \
                self.render(system, spliced, content, setup)
            matches.append((session, spliced, prompt_ids))
        return await self.branch(owner, system, history, plain_ids, matches), plain_ids, False

    async def branch(self, owner: str | None, system: str | None, history: list[Message], plain_ids: list[int],
                      matches: list[tuple[Session, list[Message], list[int]]]) -> Session:
        """A new session, claimed, for `history`: its cache starts as a copy of the part it shares with the
        match (session, spliced history, prompt ids) that shares the most, when that is a block or more."""
        best, best_history, best_ids, shared = None, history, plain_ids, 0
        for session, spliced, prompt_ids in matches:
            if (reach := common_prefix_length(session.token_ids, prompt_ids)) > shared:
                best, best_history, best_ids, shared = session, spliced, prompt_ids, reach
        session = await self.sessions.create(system, owner=owner, messages=best_history)
        self.turns.try_claim(session.session_id)  # new: nobody else can know it yet
        if best is not None and shared >= BLOCK:
            self.engine.fork_session(best.session_id, session.session_id, best_ids)
        return session

    async def branch_from(self, owner: str | None, system: str | None, history: list[Message],
                          content: str | list[Message], source: Session, setup: ToolSetup | None = None) -> Session:
        """A new session, claimed, for `history` (its replies spliced with `source`'s ids), its cache a copy
        of the part it shares with `source`'s."""
        spliced = _splice(history, source.messages)
        prompt_ids = self.render(system, spliced, content, setup)
        return await self.branch(owner, system, history, prompt_ids, [(source, spliced, prompt_ids)])

    async def begin(self, session: Session, content: str | list[Message], params: SamplingParams, turn_id: str,
                    owner: str | None, client: str, expected_version: int | None = None, api: str = "openai",
                    setup: ToolSetup | None = None) -> StartedTurn | ErrorMessage:
        """`TurnRunner.begin_turn` for a claimed session; the claim is released when it does not start."""
        try:
            started = await self.turns.begin_turn(session, content, params, turn_id, owner, client, api=api,
                                                  expected_version=expected_version,
                                                  tools=setup or ToolSetup(self.tool_format()))
        except BaseException:
            self.turns.release_claim(session.session_id)
            raise
        if isinstance(started, ErrorMessage):
            self.turns.release_claim(session.session_id)
        return started

    async def _candidates(self, owner: str | None, prompt_ids: list[int], hint: str | None) -> list[Session]:
        """The owner's sessions that may hold this conversation: the hinted one, then the index's
        matches, each verified against its real ids, longest shared prefix first."""
        found: list[Session] = []
        for session_id in ([hint] if hint else []) + await self.index.candidates(owner, prompt_ids):
            session = await self.sessions.get(session_id)
            if session is None:
                await self.index.remove(session_id, owner, prompt_ids)
            elif session.owner == owner and all(s.session_id != session_id for s in found):
                found.append(session)
        found.sort(key=lambda s: common_prefix_length(s.token_ids, prompt_ids), reverse=True)
        return found

    def authenticate(self, request: Request) -> str | None:
        """The key's id; 401 for a missing or unknown key when the server has keys. Without keys any
        bearer token is accepted (OpenAI's clients always send one)."""
        if not self.keys.required:
            return None
        _, owner = self.keys.bearer(request.headers)
        if owner is None:
            raise ApiError(401, "missing or unknown API key: send Authorization: Bearer <key>",
                           code="invalid_api_key")
        return owner

    def refuse_when_unavailable(self) -> None:
        if self.engine.failure is not None:
            raise ApiError(503, f"the engine failed: {self.engine.failure}", code="unavailable")
        if not self.engine.ready.is_set():
            raise ApiError(503, "the model is still loading; retry shortly", code="unavailable",
                           retry_after_s=1.0)
        if self.turns.draining:
            raise ApiError(503, "the server is shutting down; retry on another worker", code="unavailable")
        if self.engine.waiting >= self.settings.max_waiting:
            raise ApiError(503, f"the server is at capacity ({self.engine.waiting} turns waiting); retry shortly",
                           code="busy", retry_after_s=1.0)

    def model_names(self) -> set[str]:
        names = {self.settings.model}
        if self.engine.loaded is not None:
            names.add(self.engine.loaded.name)
        return names

    def render(self, system: str | None, history: list[Message], content: str | list[Message],
               setup: ToolSetup | None = None) -> list[int]:
        """The prompt's ids, as the engine renders the session's turn."""
        if self._renderer is None:
            self._renderer = PromptRenderer(self.engine.loaded.tokenizer)
        setup = setup or ToolSetup(self.tool_format())
        messages = Session("", system=system, messages=history).prompt_messages(content)
        return self._renderer.render(setup.engine_messages(messages), tools=setup.template_tools())


def _splice(sent: list[Message], stored: list[Message]) -> list[Message]:
    """`sent`, with each reply that `stored` holds at the same place with the same text and calls carrying
    the ids the model generated for it."""
    return [known if index < len(stored) and (known := stored[index]).token_ids is not None
            and _key(known) == _key(message) else message
            for index, message in enumerate(sent)]


def _key(message: Message) -> tuple:
    """What makes two messages the same for a client that resends them: role, text, calls (arguments compared as
    JSON, as clients re-serialize them) and the call a result answers; never the ids the model generated."""
    return (message.role, message.content, tuple((call.name, _normal(call.arguments)) for call in message.tool_calls),
            message.tool_call_id)


def _normal(arguments: str) -> str:
    try:
        return json.dumps(json.loads(arguments), sort_keys=True)
    except ValueError:
        return arguments


def _ids_of(messages: list[Message]) -> list[tuple[int, ...] | None]:
    return [message.token_ids for message in messages]


def _same(stored: list[Message], sent: list[Message]) -> bool:
    return [_key(m) for m in stored] == [_key(m) for m in sent]


def _finish(result: TurnResult, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_calls"
    return {"length": "length", "grammar": "grammar_error"}.get(result.finish_reason, "stop")


def _without_none(fields: dict) -> dict:
    return {key: _without_none(value) if isinstance(value, dict) else value
            for key, value in fields.items() if value is not None}


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


def _usage(result: TurnResult) -> CompletionUsage:
    return CompletionUsage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                           total_tokens=result.prompt_tokens + result.completion_tokens,
                           prompt_tokens_details=CompletionTokensDetails(cached_tokens=result.cached_tokens))

