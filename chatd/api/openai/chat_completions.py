"""The OpenAI-compatible API: `GET /v1/models` and `POST /v1/chat/completions`, streamed (SSE) or not.

OpenAI clients are stateless: each request carries the whole conversation and no session id; `Conversations`
finds the session it continues (or branches one), and the turn runs through the `TurnRunner` exactly as a
websocket turn does (claims, rate limit, leases, metrics, recording).
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatd.api.admission import Admission
from chatd.api.constants import ARGUMENTS_FRAGMENT, SESSION_HEADER, WORKER, WORKER_HEADER
from chatd.api.conversations import Conversations, salted
from chatd.api.http_errors import ApiError, refusals
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
    ErrorResponse,
    FunctionCallDelta,
    FunctionCallOut,
    ModelCard,
    ModelList,
    ToolCallDelta,
    ToolCallOut,
)
from chatd.api.openai.errors import openai_body
from chatd.api.openai.prompt_cache import IMPLICIT, CacheAccount
from chatd.api.tool_calling import ToolSetup
from chatd.api.turns import StartedTurn, TurnPlan, TurnRunner
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TurnFailed, TurnResult
from sessions import ToolCall

log = logging.getLogger(__name__)


class OpenAIApi:
    """The OpenAI-compatible chat routes over the turn runner."""

    def __init__(self, admission: Admission, conversations: Conversations, turns: TurnRunner):
        self.admission, self.conversations, self.turns = admission, conversations, turns
        self.created = int(time.time())
        self.router = APIRouter(prefix="/v1")
        self.router.add_api_route("/models", self.models, methods=["GET"], response_model=ModelList)
        self.router.add_api_route("/models/{model:path}", self.model, methods=["GET"], response_model=ModelCard)
        self.router.add_api_route("/chat/completions", self.chat_completions, methods=["POST"],
                                  response_model=ChatCompletion,
                                  responses={code: {"model": ErrorResponse} for code in (400, 401, 404, 429, 503)})

    async def models(self, request: Request) -> ModelList:
        self.admission.authenticate(request)
        return ModelList(data=[ModelCard(id=self.admission.settings.model, created=self.created)])

    async def model(self, request: Request, model: str) -> ModelCard:
        """The served model by its name (OpenAI's `models.retrieve`); another name is a 404 in OpenAI's shape."""
        self.admission.authenticate(request)
        self.admission.check_model(model)
        return ModelCard(id=model, created=self.created)

    async def chat_completions(self, request: Request, body: ChatCompletionRequest,
                               x_session_id: Annotated[str | None, Header()] = None) -> Response:
        owner, max_new_tokens = self.admission.open(request, body, body.max_completion_tokens or body.max_tokens)
        with refusals():
            setup = body.tool_setup(self.conversations.tool_format())
        client = owner or (request.client.host if request.client else "unknown")
        self.admission.check_token_ids(body.stop_token_ids, "stop_token_ids")
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=body.stop_list(), grammar=await self.admission.compile(setup),
                                ignore_eos=body.ignore_eos, min_tokens=min(body.min_tokens, max_new_tokens),
                                stop_token_ids=tuple(body.stop_token_ids))
        turn_id = "chatcmpl-" + secrets.token_urlsafe(12)
        scope = salted(owner, body.cache_salt)
        system, history, content = body.conversation()
        plan = TurnPlan(content, params, setup, keep_for_s=body.keep_for_s())
        session, started = await self.conversations.start(
            scope, client, system, history, content, body.session_id or x_session_id, plan, turn_id, "openai",
            cache_key=body.prompt_cache_key)
        first, events = await self.conversations.relay(scope, started, body.prompt_cache_key)
        cache = CacheAccount(True, self._breakpoint_ids(body, setup)) if body.explicit_cache else IMPLICIT
        headers = {SESSION_HEADER: session.session_id, WORKER_HEADER: WORKER}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._stream(started, first, events, body.model, include_usage, setup, cache),
                                     media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        result = await self.conversations.result(first, events)
        text, calls = started.reply
        message = AssistantMessage(content=text or None if calls else text,
                                   tool_calls=[_call_out(call) for call in calls] or None)
        completion = ChatCompletion(id=turn_id, created=int(time.time()), model=body.model, choices=[Choice(
            message=message, finish_reason=_finish(result, calls))], usage=completion_usage(result, cache))
        return JSONResponse(completion.model_dump(), headers=headers)

    def _breakpoint_ids(self, body: ChatCompletionRequest, setup: ToolSetup) -> list[int]:
        """The prompt's ids up to the end of the message holding the request's last `prompt_cache_breakpoint` ([]:
        none); the request holds the whole conversation."""
        marks = body.breakpoints()
        if not marks:
            return []
        index = max(index for index, _ in marks)
        system, history, content = body.conversation()
        if system is not None:
            if index == 0:
                return self.conversations.render(system, [], [], setup, add_generation_prompt=False)
            index -= 1
        messages = history + content
        return self.conversations.render(system, messages[:index], messages[index:index + 1], setup,
                                         add_generation_prompt=False)

    async def _stream(self, started: StartedTurn, first: str | TurnResult, events: asyncio.Queue, model: str,
                      include_usage: bool, setup: ToolSetup, cache: CacheAccount) -> AsyncIterator[str]:
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
                yield f"data: {openai_body(ApiError.of(event)).model_dump_json()}\n\n"
                return
            text, calls = started.reply
            if rest := prose.rest(text, bool(calls) or prose.opened):
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
                yield chunk(ChunkDelta(), usage=completion_usage(event, cache), choices=False)
            yield "data: [DONE]\n\n"
        finally:
            if isinstance(event, str):  # the client left mid-stream
                started.turn.cancel()


def _finish(result: TurnResult, calls: list[ToolCall]) -> str:
    if calls:
        return "tool_calls"
    return {"length": "length", "grammar": "grammar_error"}.get(result.finish_reason, "stop")


def _without_none(fields: dict) -> dict:
    return {key: _without_none(value) if isinstance(value, dict) else value
            for key, value in fields.items() if value is not None}


def _call_out(call: ToolCall) -> ToolCallOut:
    return ToolCallOut(id=call.id, function=FunctionCallOut(name=call.name, arguments=call.arguments))


def completion_usage(result: TurnResult, cache: CacheAccount = IMPLICIT) -> CompletionUsage:
    """A turn's token counts as both completion APIs report them (what it wrote as `cache` counts it)."""
    return CompletionUsage(prompt_tokens=result.prompt_tokens, completion_tokens=result.completion_tokens,
                           total_tokens=result.prompt_tokens + result.completion_tokens,
                           prompt_tokens_details=CompletionTokensDetails(cached_tokens=result.cached_tokens,
                                                                         cache_write_tokens=cache.write_tokens(result)))

