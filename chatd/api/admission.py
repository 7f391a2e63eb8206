"""What an HTTP API request must pass before any model work: its API key, the model it names, the tokens it asks
for, the server's state (loaded, not draining, not at capacity) and its grammar. Each refusal is an `ApiError`,
which each API writes in its own shape (OpenAI's, Anthropic's)."""

from __future__ import annotations

from typing import Protocol

from fastapi import Request

from chatd.api.auth import KeyRing
from chatd.api.http_errors import ApiError, refusals
from chatd.api.tool_calling import ToolSetup, compile_grammar
from chatd.api.turns import TurnRunner
from chatd.config import Settings
from chatd.engine.engine import Engine
from chatd.engine.grammar import CompiledGrammar


class ReplyBody(Protocol):
    """A request body that asks for a reply: the model it names, and what of it this server cannot do."""

    model: str

    def refuse_unsupported(self) -> None: ...


class Admission:
    """The checks the HTTP APIs share."""

    def __init__(self, engine: Engine, settings: Settings, turns: TurnRunner, keys: KeyRing):
        self.engine, self.settings, self.turns, self.keys = engine, settings, turns, keys

    def authenticate(self, request: Request) -> str | None:
        """The key's id, from `Authorization: Bearer <key>` (OpenAI's clients) or `x-api-key` (Anthropic's); 401
        for a missing or unknown key when the server has keys. Without keys any key is accepted (both clients
        always send one)."""
        if not self.keys.required:
            return None
        _, owner = self.keys.bearer(request.headers)
        if owner is None and (key := request.headers.get("x-api-key")) is not None:
            owner = self.keys.identify(key.strip())
        if owner is None:
            raise ApiError(401, "missing or unknown API key: send Authorization: Bearer <key> (or x-api-key: <key>)",
                           code="invalid_api_key")
        return owner

    def open(self, request: Request, body: ReplyBody, requested: int | None) -> tuple[str | None, int]:
        """A reply's opening checks, in the order a client learns of its mistakes (who it is, what the body asks
        that cannot be done, the model, then the server's state): the key's id and the reply's token cap."""
        owner = self.authenticate(request)
        with refusals():
            body.refuse_unsupported()
        self.check_model(body.model)
        self.refuse_when_unavailable()
        return owner, self.max_new_tokens(requested)

    def model_names(self) -> set[str]:
        names = {self.settings.model}
        if self.engine.loaded is not None:
            names.add(self.engine.loaded.name)
        return names

    def check_model(self, model: str) -> None:
        """404 for a model this server does not serve."""
        if model not in self.model_names():
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {self.settings.model!r}",
                           param="model", code="model_not_found")

    def max_new_tokens(self, requested: int | None) -> int:
        """The tokens a reply may have: what the client asked for, up to the server's limit (`--max-new-tokens`),
        which is also the limit without a request. Clients ask for more than any server will give (4096 for a model
        the AI SDK does not know, 128000 from litellm): the reply stops at the limit with `length`, as at OpenAI's
        and Anthropic's own, rather than refusing the request."""
        return min(requested or self.settings.max_new_tokens, self.settings.max_new_tokens)

    def check_token_ids(self, token_ids: list[int], param: str) -> None:
        """400 for a token id the served model does not have (once it is loaded: before, the request waits)."""
        if self.engine.loaded is None:
            return
        for index, token_id in enumerate(token_ids):
            if not 0 <= token_id < self.engine.loaded.vocab_size:
                raise ApiError(400, f"{param}[{index}]: {token_id} is not a token of the served model (its ids are "
                                    f"0 to {self.engine.loaded.vocab_size - 1})", param=f"{param}[{index}]",
                               code="bad_request")

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

    async def compile(self, setup: ToolSetup, format_param: str = "response_format") -> CompiledGrammar | None:
        """The reply's grammar; a 400 naming the tools or the response format when it cannot compile."""
        with refusals():
            return await compile_grammar(self.engine.grammars, setup, format_param)
