"""vLLM's `POST /tokenize` and `POST /detokenize`: a KV-aware router (or its client) tokenizes a chat request exactly
as a turn renders it, so that the blocks it looks up are the blocks a worker published (`--kv-events-endpoint`)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from chatd.api.admission import Admission
from chatd.api.conversations import Conversations
from chatd.api.http_errors import ApiError, refusals
from chatd.api.openai.chat_schema import ChatCompletionRequest, ChatMessageIn, ToolDefinition
from chatd.model.loader import LoadedModel


class TokenizeRequest(BaseModel):
    """A prompt, or chat messages (with tools) rendered as a turn renders them."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: str | None = Field(None, max_length=4_000_000)
    messages: list[ChatMessageIn] | None = Field(None, min_length=1)
    tools: list[ToolDefinition] | None = Field(None, max_length=128)
    add_generation_prompt: bool = True
    add_special_tokens: bool = True


class TokenizeResponse(BaseModel):
    """The ids, their count and the model's context length (vLLM's shape)."""

    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeRequest(BaseModel):
    """Token ids to turn back into text."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    tokens: list[int] = Field(max_length=4_000_000)


class DetokenizeResponse(BaseModel):
    """The text of the ids (vLLM's shape)."""

    prompt: str


class TokenizeApi:
    """The two routes, over the served model's tokenizer and the conversations' renderer."""

    def __init__(self, admission: Admission, conversations: Conversations):
        self.admission, self.conversations = admission, conversations
        self.router = APIRouter()
        self.router.add_api_route("/tokenize", self.tokenize, methods=["POST"], response_model=TokenizeResponse)
        self.router.add_api_route("/detokenize", self.detokenize, methods=["POST"], response_model=DetokenizeResponse)

    async def tokenize(self, request: Request, body: TokenizeRequest) -> TokenizeResponse:
        """Tokenized in a thread: a prompt of megabytes must not stall the event loop (and every stream on it)."""
        self.admission.authenticate(request)
        loaded = self._loaded()
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "send either prompt (text) or messages (a chat request)", param="messages",
                           code="bad_request")
        if body.prompt is not None:
            tokens = await asyncio.to_thread(loaded.tokenizer.encode, body.prompt,
                                             add_special_tokens=body.add_special_tokens)
        else:
            chat = ChatCompletionRequest(model=body.model or "", messages=body.messages, tools=body.tools)
            with refusals():
                setup = chat.tool_setup(self.conversations.tool_format())
            system, history, content = chat.conversation()
            tokens = await asyncio.to_thread(self.conversations.render, system, history, content, setup,
                                             body.add_generation_prompt)
        return TokenizeResponse(tokens=tokens, count=len(tokens), max_model_len=loaded.max_context)

    async def detokenize(self, request: Request, body: DetokenizeRequest) -> DetokenizeResponse:
        self.admission.authenticate(request)
        tokenizer = self._loaded().tokenizer
        if any(token < 0 or token >= len(tokenizer) for token in body.tokens):
            raise ApiError(400, f"token ids are 0 to {len(tokenizer) - 1}", param="tokens", code="bad_request")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens))

    def _loaded(self) -> LoadedModel:
        """The served model; a 503 (retry shortly) while it loads."""
        loaded = self.conversations.engine.loaded
        if loaded is None:
            raise ApiError(503, "the model is still loading; retry shortly", code="unavailable", retry_after_s=1.0)
        return loaded
