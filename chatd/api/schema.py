"""Every API as one JSON Schema document, generated from the pydantic models that parse and answer them,
so that clients in any language validate against what the server really speaks:
`python -m chatd.api.schema > docs/protocol.schema.json` (a test keeps the file in step with the models)."""

from __future__ import annotations

import json

from pydantic import TypeAdapter

from chatd.api.anthropic.messages_schema import CountTokensRequest, ErrorOut, MessageOut, MessagesRequest, TokenCount
from chatd.api.openai.chat_schema import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ErrorResponse,
    ModelList,
)
from chatd.api.openai.compaction import CompactedResponse, CompactRequest
from chatd.api.openai.responses_schema import (
    ConversationCreate,
    ConversationObject,
    ItemList,
    ResponseObject,
    ResponseRequest,
)
from chatd.api.websocket.protocol import json_schemas


def protocol_schema() -> dict:
    """Every API's JSON Schemas in one document."""
    openai = {name: TypeAdapter(model).json_schema() for name, model in [
        ("chat_completions_request", ChatCompletionRequest), ("chat_completion", ChatCompletion),
        ("chat_completion_chunk", ChatCompletionChunk), ("models", ModelList), ("error", ErrorResponse),
        ("response_request", ResponseRequest), ("response", ResponseObject),
        ("conversation_create", ConversationCreate), ("conversation", ConversationObject), ("items", ItemList),
        ("compact_request", CompactRequest), ("compacted_response", CompactedResponse)]}
    anthropic = {name: TypeAdapter(model).json_schema() for name, model in [
        ("messages_request", MessagesRequest), ("message", MessageOut), ("count_tokens_request", CountTokensRequest),
        ("token_count", TokenCount), ("error", ErrorOut)]}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "chatd protocols",
            "description": "websocket: frames on /ws (docs/protocol.md); openai: bodies of /v1/chat/completions, "
                           "/v1/models (docs/protocol.md#the-openai-compatible-api), /v1/responses and "
                           "/v1/responses/compact, /v1/conversations "
                           "(docs/protocol.md#the-responses-and-conversations-apis); anthropic: "
                           "bodies of /v1/messages and /v1/messages/count_tokens "
                           "(docs/protocol.md#the-anthropic-messages-api)",
            "websocket": json_schemas(), "openai": openai, "anthropic": anthropic}


def render() -> str:
    """The schema document as the checked-in file holds it."""
    return json.dumps(protocol_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    print(render(), end="")
