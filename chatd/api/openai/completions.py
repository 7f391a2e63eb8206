"""OpenAI's text completions (`POST /v1/completions`), what `vllm bench serve`, GuideLLM and many older tools send:
a prompt's text, no chat template. The prompt is tokenized as transformers' tokenizer does and matched by its token
ids against the key's sessions (the prefix index): each request runs in a new session whose cache starts as a copy
of the longest cached prefix it shares, so a client that sends its growing prompt again prefills only what is new."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import AsyncIterator
from typing import Literal

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field
from starlette.responses import JSONResponse, Response, StreamingResponse

from chatd.api.admission import Admission
from chatd.api.constants import SESSION_HEADER, WORKER, WORKER_HEADER
from chatd.api.conversations import Conversations, salted
from chatd.api.http_errors import ApiError, store_call
from chatd.api.openai.chat_completions import completion_usage
from chatd.api.openai.chat_schema import CompletionUsage, StreamOptions
from chatd.api.openai.errors import openai_body
from chatd.api.openai.request_body import RequestBody
from chatd.api.tool_calling import RequestRefused
from chatd.api.turns import StartedTurn, TurnPlan, TurnRequest
from chatd.engine.sampling import SamplingParams
from chatd.engine.turn import TurnFailed, TurnResult

DEFAULT_MAX_TOKENS = 16  # OpenAI's default for text completions


class CompletionRequest(RequestBody):
    """A text completion's body; parameters that would change the reply's meaning are refused by name."""

    model: str
    prompt: str | list[str] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, max_length=256)
    cache_salt: str | None = Field(None, max_length=256)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=64)
    n: int = 1
    echo: bool = False
    suffix: str | None = None
    logprobs: int | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        """Raise `RequestRefused` for what chatd does not do, naming it."""
        if isinstance(self.prompt, list) and len(self.prompt) != 1:
            raise RequestRefused("prompt", "one prompt per request: chatd returns one choice")
        for name, neutral in (("n", (1,)), ("echo", (False,)), ("suffix", (None,)), ("logprobs", (None,)),
                              ("best_of", (None, 1))):
            if getattr(self, name) not in neutral:
                raise RequestRefused(name, f"{name} is not supported")
        if self.min_tokens > (self.max_tokens or self.min_tokens):
            raise RequestRefused("min_tokens", "min_tokens is more than max_tokens")

    def text(self) -> str:
        """The prompt's text."""
        return self.prompt if isinstance(self.prompt, str) else self.prompt[0]


class CompletionChoice(BaseModel):
    """The one choice of a text completion."""

    text: str
    index: int = 0
    logprobs: None = None
    finish_reason: Literal["stop", "length"] | None = None


class TextCompletion(BaseModel):
    """A text completion, or (`stream`) one event of it."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: CompletionUsage | None = None


class CompletionsApi:
    """`POST /v1/completions` over the prefix index and the turn runner."""

    def __init__(self, admission: Admission, conversations: Conversations):
        self.admission, self.conversations, self.turns = admission, conversations, conversations.turns
        self.router = APIRouter(prefix="/v1")
        self.router.add_api_route("/completions", self.complete, methods=["POST"], response_model=TextCompletion)

    async def complete(self, request: Request, body: CompletionRequest) -> Response:
        owner, max_new_tokens = self.admission.open(request, body, body.max_tokens or DEFAULT_MAX_TOKENS)
        self.admission.check_token_ids(body.stop_token_ids, "stop_token_ids")
        client = owner or (request.client.host if request.client else "unknown")
        scope = salted(owner, body.cache_salt)
        stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        params = SamplingParams(max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
                                seed=body.seed, stop=stop, ignore_eos=body.ignore_eos,
                                min_tokens=min(body.min_tokens, max_new_tokens),
                                stop_token_ids=tuple(body.stop_token_ids))
        prompt_ids = await asyncio.to_thread(lambda: self.admission.engine.loaded.tokenizer(body.text())["input_ids"])
        session = await store_call(self.conversations.place_text(scope, prompt_ids))
        turn_id = "cmpl-" + secrets.token_urlsafe(12)
        started = await self.turns.start(TurnRequest(session.session_id, turn_id, scope, client, "openai",
                                                     TurnPlan(body.text(), params, raw=True)))
        if not isinstance(started, StartedTurn):
            raise ApiError.of(started)
        first, events = await self.conversations.relay(scope, started)
        headers = {SESSION_HEADER: session.session_id, WORKER_HEADER: WORKER}
        if body.stream:
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(_stream(started, first, events, body.model, include_usage),
                                     media_type="text/event-stream", headers={**headers, "Cache-Control": "no-cache"})
        result = await self.conversations.result(first, events)
        completion = TextCompletion(id=turn_id, created=int(time.time()), model=body.model, choices=[
            CompletionChoice(text=result.content, finish_reason=_finish(result))], usage=completion_usage(result))
        return JSONResponse(completion.model_dump(), headers=headers)


async def _stream(started: StartedTurn, first: str | TurnResult, events: asyncio.Queue, model: str,
                  include_usage: bool) -> AsyncIterator[str]:
    """Server-sent events: the text as it comes, the finish reason, the usage if asked, [DONE]. A client that goes
    away cancels the turn."""
    turn_id, created = started.turn.turn_id, int(time.time())

    def chunk(text: str, finish: str | None = None, usage: CompletionUsage | None = None) -> str:
        event = TextCompletion(id=turn_id, created=created, model=model, usage=usage,
                               choices=[] if usage else [CompletionChoice(text=text, finish_reason=finish)])
        return f"data: {json.dumps(event.model_dump(), ensure_ascii=False)}\n\n"

    event = first
    try:
        while isinstance(event, str):
            yield chunk(event)
            event = await events.get()
        if isinstance(event, TurnFailed):
            yield f"data: {openai_body(ApiError.of(event)).model_dump_json()}\n\n"
            return
        yield chunk("", _finish(event))
        if include_usage:
            yield chunk("", usage=completion_usage(event))
        yield "data: [DONE]\n\n"
    finally:
        if isinstance(event, str):  # the client left mid-stream
            started.turn.cancel()


def _finish(result: TurnResult) -> str:
    return "length" if result.finish_reason == "length" else "stop"
