"""docs/protocol.schema.json is generated from the models that parse and answer both APIs, and stays so."""

import json
from pathlib import Path

import jsonschema
import pytest

from chatd.api.schema import protocol_schema, render

SCHEMA_FILE = Path(__file__).resolve().parent.parent / "docs" / "protocol.schema.json"


def test_the_checked_in_schema_is_the_models_schema():
    assert SCHEMA_FILE.read_text() == render(), "regenerate: python -m chatd.api.schema > docs/protocol.schema.json"


@pytest.mark.parametrize("message, valid", [
    ({"type": "chat.request", "session_id": "s", "content": "hi", "params": {"max_new_tokens": 8}}, True),
    ({"type": "chat.request", "session_id": "s", "content": ""}, False),
    ({"type": "session.open", "system": "Be brief."}, True),
    ({"type": "nonsense"}, False),
])
def test_client_messages_validate_against_the_schema(message, valid):
    schema = protocol_schema()["websocket"]["client_to_server"]
    errors = list(jsonschema.Draft202012Validator(schema).iter_errors(message))
    assert (not errors) == valid, errors


def test_an_openai_chunk_validates_and_a_bad_request_does_not():
    openai = protocol_schema()["openai"]
    chunk = {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m", "usage": None,
             "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None,
                          "logprobs": None}]}
    jsonschema.validate(chunk, openai["chat_completion_chunk"])
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": "m", "messages": []}, openai["chat_completions_request"])
    assert json.loads(render())["websocket"]["server_to_client"]["discriminator"]["propertyName"] == "type"
