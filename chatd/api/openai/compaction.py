"""`POST /v1/responses/compact` and the compaction items it returns: a long conversation made short by dropping its
oldest turns, as the context shift does (no summary: the served model is not asked to rewrite the history), the window
prefilled into a session of its own whose system prompt is read from the cache. The compaction item names that
session: a response whose input holds it continues there, over HTTP or the WebSocket mode, and only its new input is
prefilled."""

from __future__ import annotations

import secrets
import time
from typing import Any, Literal

from pydantic import BaseModel, Field

from chatd.api.conversations import salted
from chatd.api.http_errors import ApiError, refusals, store_call
from chatd.api.openai.input_items import CompactionItem, InputItemIn
from chatd.api.openai.request_body import RequestBody
from chatd.api.openai.response_turns import ResponseTurns
from chatd.api.openai.responses_schema import InputTokensDetails, ResponseRequest, ResponseUsage
from chatd.api.tool_calling import ToolSetup
from chatd.api.turn_errors import ErrorMessage
from chatd.api.turns import TurnPlan, TurnRequest
from chatd.engine.sampling import SamplingParams
from chatd.model.context_window import DoesNotFit, fit
from chatd.model.prompt import PromptRenderer
from sessions import Message

WINDOW_SHARE = 4  # a compacted window keeps the newest turns within a quarter of the model's context


class CompactRequest(RequestBody):
    """The body of `POST /v1/responses/compact` (`tools`, chatd's: the tools the next turns send, so that the window
    is prefilled as they render it; a chain's own by default)."""

    model: str
    input: str | list[InputItemIn] = Field(default_factory=list)
    instructions: str | None = None
    previous_response_id: str | None = Field(None, max_length=128)
    tools: list[dict[str, Any]] | None = Field(None, max_length=128)
    cache_salt: str | None = Field(None, max_length=256)
    safety_identifier: str | None = Field(None, max_length=256)


class CompactedResponse(BaseModel):
    """A compaction as OpenAI's `CompactedResponse`: the window's user messages, then one compaction item."""

    id: str
    object: Literal["response.compaction"] = "response.compaction"
    created_at: int
    output: list[dict[str, Any]]
    usage: ResponseUsage
    safety_identifier: str | None = None


class Compactions:
    """Compacts conversations into windows that start new chains."""

    def __init__(self, response_turns: ResponseTurns):
        self.response_turns = response_turns
        self.admission, self.conversations = response_turns.admission, response_turns.conversations
        self.sessions, self.turns, self.store = response_turns.sessions, response_turns.turns, response_turns.store

    async def compact(self, owner: str | None, client: str, body: CompactRequest) -> CompactedResponse:
        """The conversation (a chain's, and/or `input`) cut to its newest turns, prefilled into a session of its
        own; the compaction item names it."""
        self.admission.check_model(body.model)
        self.admission.refuse_when_unavailable()
        scope = salted(owner, body.cache_salt)
        request = await self.response_turns.resolve_references(owner, ResponseRequest(
            model=body.model, input=body.input, instructions=body.instructions, tools=body.tools,
            previous_response_id=body.previous_response_id, generate=False, cache_salt=body.cache_salt))
        system, messages, tools = await self._conversation(owner, scope, request)
        if not messages:
            raise ApiError(400, "there is nothing to compact: give input or previous_response_id", param="input",
                           code="bad_request")
        with refusals():
            setup = request.model_copy(update={"tools": tools}).tool_setup(self.conversations.tool_format())
        kept = self._window(system, messages, setup)
        session = await store_call(self.sessions.create(system, owner=scope))
        compaction_id = "cmp_" + secrets.token_hex(16)
        started = await self.turns.start(TurnRequest(session.session_id, compaction_id, scope, client, "responses",
                                                     TurnPlan(kept, SamplingParams(max_new_tokens=1), setup,
                                                              generate=False)))
        if isinstance(started, ErrorMessage):
            raise ApiError.of(started)
        result = await self.conversations.result(*await self.conversations.relay(scope, started))
        output = [{"id": f"msg_{compaction_id[4:]}_{index}", "type": "message", "role": "user", "status": "completed",
                   "content": [{"type": "input_text", "text": message.content}]}
                  for index, message in enumerate(kept) if message.role == "user"]
        output.append({"id": compaction_id, "type": "compaction", "created_by": "chatd",
                       "encrypted_content": CompactionItem.content_for(session.session_id, started.session.version,
                                                                       len(started.session.messages))})
        usage = ResponseUsage(input_tokens=result.prompt_tokens, output_tokens=0, total_tokens=result.prompt_tokens,
                              input_tokens_details=InputTokensDetails(
                                  cached_tokens=result.cached_tokens,
                                  cache_write_tokens=result.prompt_tokens - result.cached_tokens))
        return CompactedResponse(id=compaction_id, created_at=int(time.time()), output=output, usage=usage,
                                 safety_identifier=body.safety_identifier)

    async def _conversation(self, owner: str | None, scope: str | None, request: ResponseRequest
                            ) -> tuple[str | None, list[Message], list[dict[str, Any]] | None]:
        """(system prompt, messages, tools) of what is compacted: the chain up to `previous_response_id` (with its
        tools unless the request names some), a compaction item's window, then the rest of `input`."""
        system, history, tools = request.instructions, [], request.tools
        if request.previous_response_id:
            previous = await store_call(self.store.get(request.previous_response_id))
            session = await store_call(self.sessions.get(previous.session_id)) if previous is not None and \
                previous.owner == owner else None
            if session is None or session.owner != scope:
                raise ApiError(404, f"previous response {request.previous_response_id!r} not found",
                               param="previous_response_id", code="previous_response_not_found")
            system = system if system is not None else session.system
            history = session.messages[:previous.messages]
            tools = tools if tools is not None else previous.body.get("tools") or None
        compacted, request = await self.response_turns.compacted(scope, request)
        if compacted is not None:
            window, _, count = compacted
            system = system if system is not None else window.system
            history = window.messages[:count]
        messages = request.messages()
        if messages and messages[0].role == "system":
            system, messages = (messages[0].content if system is None else system), messages[1:]
        return system, history + messages, tools

    def _window(self, system: str | None, messages: list[Message], setup: ToolSetup) -> list[Message]:
        """The newest turns of the conversation within a quarter of the model's context (at least its last turn),
        cut where the context shift cuts: after a reply, never before a tool's result."""
        loaded = self.conversations.engine.loaded
        whole = ([Message("system", system)] if system is not None else []) + messages
        renderer, tools = PromptRenderer(loaded.tokenizer), setup.template_tools()
        engine_messages = setup.engine_messages(whole)
        try:
            window = fit(renderer, engine_messages, 0, loaded.max_context // WINDOW_SHARE, 0, tools,
                         add_generation_prompt=False)
        except DoesNotFit:
            try:
                window = fit(renderer, engine_messages, len(messages), loaded.max_context, 0, tools,
                             add_generation_prompt=False)
            except DoesNotFit as error:
                raise ApiError(400, str(error), param="input", code="context_length_exceeded") from None
        kept = len([message for message in window.messages if message.role != "system"])
        return messages[len(messages) - kept:]
